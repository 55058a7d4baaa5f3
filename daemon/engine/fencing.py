"""Fencing by the version registry (DESIGN §2, §4): what a put may claim, what a load expects.

``Fences(stack)`` — one per engine, over ``stack.registry``:

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
"""

from __future__ import annotations

import dataclasses

from statetier.protocol.errors import StaleState, StatetierError
from statetier.protocol.identity import StateKey, stream_id
from statetier.protocol.lru import BoundedLru
from statetier.protocol.sealed import Expectation
from statetier.tiers.registry import Claim, Claimed

from ..requests import LoadRequest
from .stack import Stack

#: state_id → the stream it was issued for, remembered for this many state_ids.
STREAMS_REMEMBERED = 1 << 16


class Fences:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.registry = stack.registry
        self._issued: BoundedLru[bytes, bytes] = BoundedLru(STREAMS_REMEMBERED)  # state_id -> stream

    async def claim_many(self, claims: list[Claim]) -> list[Claimed | StaleState | None]:
        """The versions of a batch of puts, in one registry call; a stale put is a refused
        object, counted."""
        answers = await self.registry.claim_many(claims)
        for claim, answer in zip(claims, answers):
            if isinstance(answer, StaleState):
                self.stack.count_rejection(answer)
            elif answer is not None:
                self._remember_stream(claim.state_id, claim.stream_id)
        return answers

    async def withdraw(self, claimed: list[tuple[Claim, Claimed]]) -> None:
        if claimed:
            await self.registry.withdraw(claimed)

    async def expect_refs(self, reqs: list[LoadRequest]) -> list[Expectation | StatetierError | None]:
        """What each load by ref of a batch expects, from one registry call (its streams'
        heads, and the streams of the state_ids not remembered); None for a load by key, the
        error for a registry that failed."""
        by_ref = [(i, req) for i, req in enumerate(reqs) if req.ref is not None]
        out: list = [None] * len(reqs)
        if not by_ref:
            return out
        streams = [stream_id(_own_key(req), req.ref.request_id) for _, req in by_ref]
        unknown = list({req.ref.state_id for _, req in by_ref if req.ref.state_id not in self._issued})
        try:
            heads, issued = await self.registry.read_many(streams, unknown)
        except StatetierError as exc:
            for i, _ in by_ref:
                out[i] = exc
            return out
        for state_id, stream in zip(unknown, issued):
            if stream is not None:
                self._remember_stream(state_id, stream)
        for (i, req), head, stream in zip(by_ref, heads, streams):
            ref = req.ref
            out[i] = Expectation.for_ref(
                ref, req.namespace, newest_version=head.version if head else None,
                state_id_stream=self._issued.get(ref.state_id), tensors=req.tensors,
                allow_speculative=req.allow_speculative, stream=stream)
        return out

    async def expect_key(self, key: StateKey, stream: bytes, req: LoadRequest) -> Expectation:
        head = await self.registry.newest(stream)
        return Expectation.for_key(key, newest_version=head.version if head else None,
                                   tensors=req.tensors, allow_speculative=req.allow_speculative)

    def _remember_stream(self, state_id: bytes, stream: bytes) -> None:
        self._issued.put(state_id, stream)


def _own_key(req: LoadRequest) -> StateKey:
    """The ref's key in the requester's own namespace (DESIGN §4)."""
    key = req.ref.key
    return key if key.namespace == req.namespace else dataclasses.replace(key, namespace=req.namespace)
