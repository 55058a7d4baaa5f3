"""The daemon's KV events in vLLM's own event stream: the connector's ``take_events()`` (issue 26).

vLLM publishes what its GPU cache holds; a router that reads that stream learns what statetier
holds for this engine (host memory, disk, Redis) only if the connector adds it. The daemon
publishes every copy it stores and drops (``[events]``, docs/integration.md), naming a block by
statetier's prefix hash; this module renames them to vLLM's block hashes.

- ``ConnectorEvents(endpoint, topic, hash_block_size)`` — a ZMQ SUB socket on the tenant's
  event stream, subscribed to ``topic``: the connector's namespace's, as its connection to the
  daemon names it (``AsyncClient.events_topic``: the namespace the daemon owns for the tenant,
  not the one the connector's spec names).
- ``remember(request, keys, block_size)`` — the scheduler side saves ``keys`` for ``request``:
  each key's prefix hash (a block ending at ``key.token_end``) is mapped to vLLM's hash of that
  block (``request.block_hashes`` at ``hash_block_size`` granularity: the last one inside it),
  its parent's, and its tokens. At most ``REMEMBERED_TOKENS`` tokens' worth of blocks are kept,
  least recently saved forgotten first.
- ``take()`` → the events that arrived since the last call, non-blocking, as
  ``protocol.kv_events`` values named by vLLM's hashes: each ``BlockStored`` / ``BlockRemoved``
  of a remembered block (others — blocks other engines saved, blocks forgotten — are skipped
  and counted in ``unmapped``), once per change of the media a block is in (a block is one
  object per layer: the first stored in a medium brings it there, the first removed takes it
  away); ``AllBlocksCleared`` is never passed on (a router would drop this engine's GPU blocks).
- ``group_of(vllm_hash)`` — the attention group (vLLM's index) a remembered block was saved for.
- ``as_vllm_events(events, source, kinds)`` → vLLM's ``BlockStored`` / ``BlockRemoved`` (vLLM
  imported here, hashes through vLLM's ``maybe_convert_block_hash``), with ``group_idx`` and
  ``kv_cache_spec_kind`` as vLLM 0.32 writes them: what ``take_events()`` yields.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import Kind, StateKey
from statetier.protocol.kv_events import BlockRemoved, BlockStored, Event, decode_batch

log = logging.getLogger("vllm.statetier")

REMEMBERED_TOKENS = 1 << 22
MAX_MESSAGES_PER_TAKE = 4096


@dataclass(slots=True)
class _Block:
    hash: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    media: set[str] = field(default_factory=set)  # where it was last said to be


class ConnectorEvents:
    def __init__(self, endpoint: str, topic: str, hash_block_size: int) -> None:
        import zmq

        self._zmq = zmq
        self.hash_block_size = hash_block_size
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._groups: dict[bytes, int] = {}  # vLLM's hash of a block -> its attention group (vLLM's index)
        self._tokens = 0
        self.unmapped = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.connect(endpoint)

    def remember(self, request, keys: list[StateKey], block_size: int) -> None:
        hashes = list(getattr(request, "block_hashes", None) or ())
        all_tokens = getattr(request, "all_token_ids", None) or request.prompt_token_ids or ()
        for key in keys:
            if key.prefix_hash in self._blocks:
                self._blocks.move_to_end(key.prefix_hash)
                continue
            end, start = key.token_end, key.token_end - block_size
            at = end // self.hash_block_size - 1
            if start < 0 or end % self.hash_block_size or at >= len(hashes):
                continue  # vLLM has no hash for a block ending there
            parent = hashes[start // self.hash_block_size - 1] if start else None
            block = _Block(bytes(hashes[at]), None if parent is None else bytes(parent),
                           tuple(all_tokens[start:end]))
            self._blocks[key.prefix_hash] = block
            if key.group_layers and key.kind is Kind.KV:
                self._groups[block.hash] = key.layer
            self._tokens += len(block.tokens)
        while self._tokens > REMEMBERED_TOKENS and self._blocks:
            forgotten = self._blocks.popitem(last=False)[1]
            self._tokens -= len(forgotten.tokens)
            self._groups.pop(forgotten.hash, None)

    def group_of(self, vllm_hash: bytes) -> int | None:
        """The KV cache group (vLLM's index) of a remembered block, by vLLM's hash of it."""
        return self._groups.get(vllm_hash)

    def take(self) -> list[BlockStored | BlockRemoved]:
        out: list[BlockStored | BlockRemoved] = []
        for _ in range(MAX_MESSAGES_PER_TAKE):
            try:
                frames = self._socket.recv_multipart(self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            try:
                _, events = decode_batch(frames[-1])
            except InvalidRequest as exc:
                log.warning("statetier: a KV event message was not a batch: %s", exc)
                continue
            for event in events:
                mapped = self._renamed(event)
                if mapped is not None:
                    out.append(mapped)
        return out

    def _renamed(self, event: Event) -> BlockStored | BlockRemoved | None:
        """vLLM's name for the event's block, once per change of where it is: a block has an
        object per layer (and shard), each stored and dropped on its own; the first one stored
        in a medium says the block is there, the first one to leave says it is gone."""
        if not isinstance(event, (BlockStored, BlockRemoved)):
            return None
        first = event.block_hashes[0] if len(event.block_hashes) == 1 else None
        block = self._blocks.get(first) if isinstance(first, bytes) else None  # named by a key's prefix hash
        if block is None:
            self.unmapped += 1
            return None
        if isinstance(event, BlockRemoved):
            if event.medium not in block.media:
                return None
            block.media.discard(event.medium)
            return BlockRemoved((block.hash,), event.medium)
        if event.medium in block.media:
            return None
        block.media.add(event.medium)
        return BlockStored((block.hash,), block.parent, block.tokens, len(block.tokens), event.medium)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


def as_vllm_events(events: list[BlockStored | BlockRemoved], source: ConnectorEvents | None = None,
                   kinds: Mapping[int, str] | None = None) -> list:
    """``take()``'s events as vLLM's own event classes (vLLM must be importable), with the
    block's ``group_idx`` (``source.group_of``) and, on a store, that group's
    ``kv_cache_spec_kind`` (``kinds``: ``connector.event_kinds``), as vLLM 0.32 writes them."""
    from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
    from vllm.distributed.kv_events import BlockStored as VllmStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out = []
    for event in events:
        first = event.block_hashes[0] if event.block_hashes else None
        group = source.group_of(first) if source is not None and isinstance(first, bytes) else None
        hashes = [maybe_convert_block_hash(h) for h in event.block_hashes]
        if isinstance(event, BlockRemoved):
            out.append(VllmRemoved(block_hashes=hashes, medium=event.medium, group_idx=group))
        else:
            parent = None if event.parent_block_hash is None else maybe_convert_block_hash(event.parent_block_hash)
            kind = (kinds or {}).get(group) if group is not None else None
            out.append(VllmStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(event.token_ids),
                                  block_size=event.block_size, lora_id=None, medium=event.medium, lora_name=None,
                                  group_idx=group, kv_cache_spec_kind=kind))
    return out
