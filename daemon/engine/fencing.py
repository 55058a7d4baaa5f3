"""Fencing by the version registry (DESIGN §2, §4): what a put may claim, what a load expects.

``Fences(stack)`` — one per engine, over ``stack.registry``:

- ``claim(req, provenance, state_id)`` → the put's version (``daemon.engine.puts``); a stale put
  raises ``StaleState``, counted as a refused object
- ``expect_ref(req)`` → ``(state_id, Expectation)`` of a load by ref: its stream's newest
  version and the stream its state_id was issued for, read together (``daemon.engine.loads``)
- ``expect_refs(reqs)`` — the same for a batch, ``REGISTRY_READS_AT_ONCE`` loads at a time
  (``Engine.expect_refs``; each answer is ``load``'s ``expected``, its error, or None)
- ``expect_key(key, stream, req)`` → the ``Expectation`` of one candidate of a load by key

The stream of each state_id claimed or read is remembered (``STREAMS_REMEMBERED`` of them:
the mapping never changes once claimed), so a load by ref mostly reads only the head.

So is the newest version this daemon has seen of each stream (claimed or read, as many
streams): versions only grow, so a registry head below it means the registry was rolled back
(a Redis writer replaying an old head) or lost the head (its TTL ran out). Loads then expect
the remembered version, so an older one is refused as ``StaleState`` on this daemon; a claim
then asks for a version above it, which writes the head forward again. ``rollbacks_seen``
counts the heads found behind (``Engine.stats``: ``registry_heads_behind``). A daemon that
never saw the newer version has only the registry to go by.
"""

from __future__ import annotations

import asyncio
import dataclasses

from statetier.protocol.errors import StaleState, StatetierError
from statetier.protocol.identity import Provenance, StateKey, stream_id
from statetier.protocol.lru import BoundedLru
from statetier.protocol.sealed import Expectation
from statetier.tiers.registry import StreamHead

from ..requests import LoadRequest, PutRequest
from .stack import Stack

#: state_id → the stream it was issued for, remembered for this many state_ids.
STREAMS_REMEMBERED = 1 << 16
#: Loads of one batch whose registry reads are in flight at once (two reads each; the
#: Redis pool holds 64 connections).
REGISTRY_READS_AT_ONCE = 16


class Fences:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.registry = stack.registry
        self._issued: BoundedLru[bytes, bytes] = BoundedLru(STREAMS_REMEMBERED)  # state_id -> stream
        self._newest: BoundedLru[bytes, int] = BoundedLru(STREAMS_REMEMBERED)  # stream -> newest version seen
        self.rollbacks_seen = 0

    async def claim(self, req: PutRequest, provenance: Provenance, state_id: bytes) -> int:
        """The put's version from the registry; a stale put is a refused object, counted."""
        stream = stream_id(req.key, provenance.request_id)
        try:
            version = await self.registry.claim(stream, state_id, req.version)
            seen = self._newest.get(stream)
            if req.version is None and seen is not None and version <= seen:  # the head went back
                self.rollbacks_seen += 1
                version = await self.registry.claim(stream, state_id, seen + 1)
        except StaleState as exc:
            self.stack.count_rejection(exc)
            raise
        self._remember_stream(state_id, stream)
        self._remember_version(stream, version)
        return version

    async def expect_refs(self, reqs: list[LoadRequest]) -> list[tuple[bytes, Expectation] | StatetierError | None]:
        """The registry reads of many loads by ref, made concurrently (``REGISTRY_READS_AT_ONCE``
        loads at a time): a batch of loads waits for a few round trips, not two per object.
        Each answer is ``load``'s ``expected``, the error reading it, or None (a load by key)."""
        out: list = [None] * len(reqs)

        async def read(index: int) -> None:
            try:
                out[index] = await self.expect_ref(reqs[index])
            except StatetierError as exc:
                out[index] = exc

        by_ref = [i for i, req in enumerate(reqs) if req.ref is not None]
        for start in range(0, len(by_ref), REGISTRY_READS_AT_ONCE):
            await asyncio.gather(*(read(i) for i in by_ref[start : start + REGISTRY_READS_AT_ONCE]))
        return out

    async def expect_ref(self, req: LoadRequest) -> tuple[bytes, Expectation]:
        ref = req.ref
        key = ref.key if ref.key.namespace == req.namespace else dataclasses.replace(ref.key, namespace=req.namespace)
        # two independent registry reads (the second often remembered): one round trip's wait
        stream = stream_id(key, ref.request_id)
        head, issued_for = await asyncio.gather(self.registry.newest(stream), self._stream_of(ref.state_id))
        return ref.state_id, Expectation.for_ref(
            ref, req.namespace, newest_version=self._newest_of(stream, head), state_id_stream=issued_for,
            tensors=req.tensors, allow_speculative=req.allow_speculative)

    async def expect_key(self, key: StateKey, stream: bytes, req: LoadRequest) -> Expectation:
        head = await self.registry.newest(stream)
        return Expectation.for_key(key, newest_version=self._newest_of(stream, head),
                                   tensors=req.tensors, allow_speculative=req.allow_speculative)

    def _newest_of(self, stream: bytes, head: StreamHead | None) -> int | None:
        """The newest version of ``stream``: the registry's, or the one seen here when the
        registry's is behind it (rolled back)."""
        seen = self._newest.get(stream)
        if head is not None and (seen is None or head.version >= seen):
            self._remember_version(stream, head.version)
            return head.version
        if seen is not None:
            self.rollbacks_seen += 1
        return seen

    def _remember_version(self, stream: bytes, version: int) -> None:
        seen = self._newest.peek(stream)
        self._newest.put(stream, version if seen is None else max(version, seen))

    def _remember_stream(self, state_id: bytes, stream: bytes) -> None:
        self._issued.put(state_id, stream)

    async def _stream_of(self, state_id: bytes) -> bytes | None:
        """The stream ``state_id`` was issued for: remembered, or read from the registry."""
        stream = self._issued.get(state_id)
        if stream is not None:
            return stream
        stream = await self.registry.stream_of(state_id)
        if stream is not None:
            self._remember_stream(state_id, stream)
        return stream
