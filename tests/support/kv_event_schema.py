"""vLLM's KV event schema, written here from ``vllm/distributed/kv_events.py`` (vLLM 0.32) and
vLLM's example subscriber (``examples/online_serving/kv_events_subscriber.py``), for the tests
to decode the daemon's stream with what a router uses, not with the daemon's own encoder.

- ``KVEventBatch`` / ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``: the 0.32 form
  (the batch an array, each event a map tagged by its class name, defaults omitted);
  ``ArrayKVEventBatch`` and its events: the earlier form, each event a tagged array.
- ``Subscriber(url, topic)`` — a real ZMQ SUB socket; ``take(n, timeout)`` the next ``n``
  messages as ``(topic, seq, batch)``; ``drain(quiet)`` every message until none arrives for
  ``quiet`` seconds; ``replay(url, start)`` asks a replay socket for the batches from ``start``.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The earlier form: every event a tagged array."""


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
ARRAY_DECODER = msgspec.msgpack.Decoder(type=ArrayKVEventBatch)


class Subscriber:
    def __init__(self, url: str, topic: bytes = b"", decoder=DECODER) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(url)
        self.decoder = decoder

    def take(self, n: int, timeout: float = 20.0) -> list[tuple[bytes, int, Any]]:
        got = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(int(left * 1000)):
                raise AssertionError(f"{len(got)} of {n} messages within {timeout} s: {got}")
            got.append(self._message(self.socket.recv_multipart()))
        return got

    def drain(self, quiet: float = 0.3) -> list[tuple[bytes, int, Any]]:
        got = []
        while self.socket.poll(int(quiet * 1000)):
            got.append(self._message(self.socket.recv_multipart()))
        return got

    def _message(self, frames: list[bytes]) -> tuple[bytes, int, Any]:
        topic, seq, payload = frames
        return topic, int.from_bytes(seq, "big"), self.decoder.decode(payload)

    def replay(self, url: str, start: int, timeout: float = 20.0) -> list[tuple[bytes, int, Any]]:
        """vLLM's replay: ``[b"", start_seq]`` to the ROUTER, one answer per batch, then the end mark."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(url)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            got = []
            while True:
                if not dealer.poll(int(timeout * 1000)):
                    raise AssertionError(f"the replay stopped after {len(got)} batches")
                _, topic, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    return got
                got.append((topic, int.from_bytes(seq, "big"), self.decoder.decode(payload)))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()
