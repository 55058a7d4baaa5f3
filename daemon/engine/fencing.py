"""Fencing by the version registry (DESIGN §2, §4): what a put may claim, what a load expects.

``Fences(stack)`` — one per engine, over ``stack.registry``:

- ``new_claim(stream, state_id, version)`` → a put's ``Claim``, carrying the newest version
  seen here of its stream (``Claim.past``)
- ``claim_many(claims)`` → each put's ``Claimed`` version, its ``StaleState`` (counted as a
  refused object) or None (not claimed: a stale claim before it ended the batch) — one
  registry call for a whole batch (``daemon.engine.puts``); ``withdraw(claimed)`` undoes the
  claims of puts that were not stored
- ``expect_refs(reqs)`` → the ``Expectation`` of each load by ref of a batch (its stream's
  newest version and the stream its state_id was issued for), from one registry call
  (``daemon.engine.loads``)
- ``expect_key(key, stream, req)`` → the ``Expectation`` of one candidate of a load by key

The stream of each state_id claimed or read is remembered (``STREAMS_REMEMBERED`` of them:
the mapping never changes once claimed), so a load by ref mostly reads only the head.

So is the newest version this daemon has seen of each stream (claimed or read, as many
streams): versions only grow, so a registry head below it means the registry was rolled back
(a Redis writer replaying an old head) or lost the head (its TTL ran out). Loads then expect
the remembered version, so an older one is refused as ``StaleState`` on this daemon; a claim
carries it (``Claim.past``), so a claim without a version gets one above it from the registry
in the same call, which writes the head forward again. ``rollbacks_seen`` counts the heads found
behind (``Engine.stats``: ``registry_heads_behind``). A withdrawn claim gives back what it
made remembered. A daemon that never saw the newer version has only the registry to go by.

A head of the ref's own version held by another state_id, the ref's own issued for the same
stream, means two attempts took one version where the registry could not order them
(claimed by two daemons while Redis was unreachable, ``tiers.tolerant_registry``; or after
a Redis that lost its data): the registry's is the one kept, so a load by ref of the other
is refused as ``StaleState``.
"""

from __future__ import annotations

import dataclasses

from statetier.protocol.errors import StaleState, StatetierError
from statetier.protocol.identity import StateKey, StateRef, stream_id
from statetier.protocol.lru import BoundedLru
from statetier.protocol.sealed import Expectation
from statetier.tiers.registry import Claim, Claimed, StreamHead

from ..requests import LoadRequest
from .stack import Stack

#: state_id → the stream it was issued for, remembered for this many state_ids.
STREAMS_REMEMBERED = 1 << 16


class Fences:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.registry = stack.registry
        self._issued: BoundedLru[bytes, bytes] = BoundedLru(STREAMS_REMEMBERED)  # state_id -> stream
        self._newest: BoundedLru[bytes, int] = BoundedLru(STREAMS_REMEMBERED)  # stream -> newest version seen
        self.rollbacks_seen = 0

    def new_claim(self, stream: bytes, state_id: bytes, version: int | None) -> Claim:
        """A put's claim (``version`` None: the next one), past the newest version seen here."""
        return Claim(stream, state_id, version, self._newest.peek(stream))

    async def claim_many(self, claims: list[Claim]) -> list[Claimed | StaleState | None]:
        """The versions of a batch of puts (``new_claim``'s), in one registry call; a stale put
        is a refused object, counted."""
        answers = await self.registry.claim_many(claims)
        for claim, answer in zip(claims, answers):
            if isinstance(answer, StaleState):
                self.stack.count_rejection(answer, claim.state_id)
            elif answer is not None:
                if claim.version is None and claim.past is not None and (
                        answer.previous is None or answer.previous.version < claim.past):
                    self.rollbacks_seen += 1  # the head was behind: this claim wrote it forward
                self._remember_stream(claim.state_id, claim.stream_id)
                self._remember_version(claim.stream_id, answer.version)
        return answers

    async def withdraw(self, claimed: list[tuple[Claim, Claimed]]) -> None:
        """Undo the claims of puts never stored: the registry's heads and the versions they
        made remembered here (the newest seen is what it was before, or the head put back)."""
        if not claimed:
            return
        await self.registry.withdraw(claimed)
        for claim, answer in reversed(claimed):
            if self._newest.peek(claim.stream_id) != answer.version:
                continue
            before = [v for v in (claim.past, answer.previous and answer.previous.version) if v]
            if before:
                self._newest.put(claim.stream_id, max(before))
            else:
                self._newest.discard(claim.stream_id)

    async def expect_refs(self, reqs: list[LoadRequest]) -> list[Expectation | StatetierError | None]:
        """What each load by ref of a batch expects, from one registry call (its streams'
        heads, and the streams of the state_ids not remembered); None for a load by key, the
        error for a registry that failed. A head behind the version seen here expects that."""
        by_ref = [(i, req, req.ref) for i, req in enumerate(reqs) if req.ref is not None]
        out: list = [None] * len(reqs)
        if not by_ref:
            return out
        streams = [stream_id(_requesters_key(req, ref), ref.request_id) for _, req, ref in by_ref]
        unknown = list({ref.state_id for _, _, ref in by_ref if ref.state_id not in self._issued})
        try:
            heads, issued = await self.registry.read_many(streams, unknown)
        except StatetierError as exc:
            for i, _, _ in by_ref:
                out[i] = exc
            return out
        for state_id, stream in zip(unknown, issued):
            if stream is not None:
                self._remember_stream(state_id, stream)
        for (i, req, ref), head, stream in zip(by_ref, heads, streams):
            newest = self._newest_of(stream, head)
            if head is not None and newest == head.version == ref.version and head.state_id != ref.state_id \
                    and self._issued.get(ref.state_id) == stream:
                newest = ref.version + 1  # another attempt of this stream holds this version: this one lost
            out[i] = Expectation.for_ref(
                ref, req.namespace, newest_version=newest,
                state_id_stream=self._issued.get(ref.state_id), tensors=req.tensors,
                allow_speculative=req.allow_speculative, stream=stream)
        return out

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


def _requesters_key(req: LoadRequest, ref: StateRef) -> StateKey:
    """The ref's key in the requester's own namespace (DESIGN §4)."""
    key = ref.key
    return key if key.namespace == req.namespace else dataclasses.replace(key, namespace=req.namespace)
