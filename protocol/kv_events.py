"""KV events in vLLM's format: what a router reads to know which prefixes statetier holds (sans-I/O).

Routers (Dynamo's KV router, llm-d's kv-cache indexer) read vLLM's KV event stream: ZMQ
messages ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian counter per stream and
``payload`` a MessagePack ``KVEventBatch`` — the array ``[ts, events]`` whose events are
``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name), ``BlockRemoved`` (block_hashes, medium) and ``AllBlocksCleared``, as
``vllm/distributed/kv_events.py`` (vLLM 0.32) defines them. Two encodings of an event are in
use (``Encoding``): ``"map"``, a map tagged by its ``"type"`` (vLLM 0.32), and ``"array"``, the
tagged array ``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium]``
(vLLM's example subscriber and the releases before). The batch is an array in both.

- ``BlockTag`` — what a client attaches to a put so that the events of its object name the
  engine's own block: ``hash`` (the engine's block hash, bytes or a u64), ``parent`` (the
  previous block's), ``tokens`` (the block's token ids); bounded, opaque to statetier.
- ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` — the events, as plain values.
- ``encode_batch(ts, events, encoding)`` → payload bytes; ``decode_batch(raw)`` → ``(ts,
  events)`` for either encoding (``InvalidRequest`` for anything else): what the vLLM
  connector reads back from the daemon's stream.
- ``event_topic(template, tenant, namespace)`` — a message's topic: ``template`` (the daemon's
  ``events.topic``) with ``{tenant}`` and ``{namespace}`` (the *owned* namespace's digest in hex,
  ``protocol.ownership``: what the events are stored under) filled in; the daemon and a
  subscriber that wants one namespace's events (``AsyncClient.events_topic``) both build it here.
- ``seq_bytes(seq)``, ``REPLAY_END``: the replay protocol of vLLM's ``ZmqEventPublisher``
  — a request ``[b"", start_seq]`` to the replay (ROUTER) socket is answered with one
  ``[b"", topic, seq, payload]`` per buffered batch from ``start_seq`` on, then
  ``[b"", b"", REPLAY_END, b""]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

from .errors import InvalidRequest

MAX_TAG_HASH_BYTES = 64
MAX_TAG_TOKENS = 16384
Encoding = Literal["map", "array"]
REPLAY_END = (-1).to_bytes(8, "big", signed=True)

U32 = Annotated[int, Meta(ge=0, le=0xFFFF_FFFF)]
BlockHash = Union[Annotated[bytes, Meta(max_length=MAX_TAG_HASH_BYTES)], Annotated[int, Meta(ge=0)]]


class BlockTag(Struct, array_like=True, gc=False, frozen=True):
    """The engine's name for a stored object's block (a put's ``tag``): carried unread into its events."""

    hash: BlockHash
    parent: BlockHash | None = None
    tokens: Annotated[tuple[U32, ...], Meta(max_length=MAX_TAG_TOKENS)] = ()


Hash = Union[bytes, int]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[Hash, ...]
    parent_block_hash: Hash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[Hash, ...]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]

_ENCODER = msgspec.msgpack.Encoder()


def event_topic(template: str, tenant: str, namespace: bytes) -> str:
    """``template`` with ``{tenant}`` and ``{namespace}`` (``namespace``: an owned namespace's digest)."""
    return template.replace("{tenant}", tenant).replace("{namespace}", namespace.hex())


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def encode_batch(ts: float, events: list[Event], encoding: Encoding = "map") -> bytes:
    """A ``KVEventBatch`` ``[ts, events]``, each event as ``encoding`` says."""
    as_wire = _as_map if encoding == "map" else _as_array
    return _ENCODER.encode([float(ts), [as_wire(event) for event in events]])


def _as_map(event: Event) -> dict[str, object]:
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": event.lora_id, "medium": event.medium, "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def _as_array(event: Event) -> list[object]:
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                event.block_size, event.lora_id, event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


_DECODER = msgspec.msgpack.Decoder()


def decode_batch(raw: bytes) -> tuple[float, list[Event]]:
    """The batch ``encode_batch`` wrote, in either encoding; ``InvalidRequest`` otherwise."""
    try:
        batch = _DECODER.decode(raw)
        ts, items = batch[0], batch[1]
        return float(ts), [_event_of(item) for item in items]
    except (msgspec.DecodeError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"not a KV event batch: {exc}") from None


def _event_of(item: Any) -> Event:
    if isinstance(item, dict):
        kind = item["type"]
        if kind == "BlockStored":
            return BlockStored(tuple(item["block_hashes"]), item["parent_block_hash"], tuple(item["token_ids"]),
                               int(item["block_size"]), item["medium"], item.get("lora_id"))
        if kind == "BlockRemoved":
            return BlockRemoved(tuple(item["block_hashes"]), item["medium"])
    else:
        kind = item[0]
        if kind == "BlockStored":
            return BlockStored(tuple(item[1]), item[2], tuple(item[3]), int(item[4]), item[6], item[5])
        if kind == "BlockRemoved":
            return BlockRemoved(tuple(item[1]), item[2])
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {str(kind)[:32]!r}")
