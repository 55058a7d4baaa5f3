"""After a batch of puts became visible: tenants, write-behind, publish, durable copies, metrics.

``PutCompletion(stack)`` — one per engine (``daemon.engine.puts``). ``finish(stored, answers,
started)`` answers each ``Stored`` item of a batch with its ``PutResult``:

- its tenant is charged for the bytes in the tier that took it (and, with KV events on, its
  block recorded first, so the charge is announced: ``daemon.engine.announcements``);
- ``durable``: it is copied into the durable tier before the answer (the answer says False
  when there is none or it could not take the object); ``publish``: it is written through
  to the cross-node tier (a batch's publishes together: ``daemon.engine.batch_copies``, one
  commit round trip on Redis), or — tolerated without one — stored locally, said and counted;
  and a write-behind copy is scheduled (no wait) for every put, published ones too: a
  publish is answered once it is in memory and described, ``durable: false``, its disk copy
  written behind (after the pulls the owner answers: ``daemon.engine.placement``); when the
  write-behind queue is full, a published put's disk copy is written before its answer
  (backpressure, never a publish left without a disk copy; the answer says ``durable``);
- one metric update for the whole batch (``observe_ops``, per tier, kind and op: ``put``,
  and ``store`` for what went into its arena reservation).

A publish that fails answers that item with its error; the object stays stored locally,
and the other items are answered as they fared.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from statetier.protocol.errors import StatetierError
from statetier.protocol.identity import StateRef
from statetier.tiers.base import ObjectMeta, Tier

from ..requests import PutRequest, PutResult
from .batch_copies import CopyItem, copy_all_into
from .stack import Stack
from .tier_copies import REQUIRED, Room

log = logging.getLogger("statetier.engine")


@dataclass(slots=True)
class Stored:
    """One put of a batch, sealed and visible in ``tier``. ``chunks``: its bytes (header,
    payload) when they are at hand; None when they live only in the arena."""

    index: int
    req: PutRequest
    meta: ObjectMeta
    tier: Tier
    chunks: list | None
    fingerprint: bytes


class PutCompletion:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    async def finish(self, stored: list[Stored], answers: list, started: float) -> None:
        stack = self.stack
        for item in stored:
            meta = item.meta
            if stack.announcements is not None:
                stack.announcements.record_put(item.req, meta)
            stack.tenancy.charge(item.req.tenant, item.tier.name, meta.object_id, meta.size)
        published = await self._publish_together(stored)
        for item in stored:
            try:
                answers[item.index] = await self._answer(item, published)
            except StatetierError as exc:
                answers[item.index] = exc
        if stored:
            self._observe(stored, (time.perf_counter() - started) / len(stored))

    def _observe(self, stored: list[Stored], seconds: float) -> None:
        """One metric update for the batch: its puts per tier and kind, and the stores into
        the arena that were its own reservations (``Placement.store`` counts the others)."""
        counts: Counter = Counter()
        sizes: Counter = Counter()
        for item in stored:
            for op in ("put", "store") if item.chunks is None else ("put",):
                group = (item.tier.name, item.meta.kind.name.lower(), op)
                counts[group] += 1
                sizes[group] += item.meta.size
        metrics = self.stack.metrics
        assert metrics is not None  # the caller observes only with metrics
        for (tier, kind, op), count in counts.items():
            metrics.observe_ops(tier, kind, op, count, sizes[(tier, kind, op)], seconds)

    async def _publish_together(self, stored: list[Stored]) -> dict[int, StatetierError | None]:
        """The copies a batch publishes, made together (``batch_copies``: one commit round
        trip on Redis): item index → None (published) or its error. Empty for fewer than two."""
        target = self.stack.publishing.target
        items = [item for item in stored if item.req.publish and target is not None and item.tier is not target]
        if len(items) < 2:
            return {}
        assert target is not None  # every item kept above names it
        copies = [CopyItem(item.tier, item.meta, item.chunks) for item in items]
        try:
            errors = await copy_all_into(self.stack.placement, target, copies)
        except StatetierError as exc:
            errors = [exc] * len(items)
        return {item.index: error for item, error in zip(items, errors)}

    async def _answer(self, item: Stored, published: dict[int, StatetierError | None]) -> PutResult:
        req, meta, tier = item.req, item.meta, item.tier
        ref = StateRef(req.key, meta.request_id, meta.step, meta.object_id, meta.version, item.fingerprint)
        if not (req.publish or req.durable):
            self.stack.placement.schedule_copy_down(meta.object_id, tier)
            return PutResult(ref, tier.name, False, tier.is_durable)
        durable = tier.is_durable or (req.durable and await self._store_durably(item))
        is_published = await self._publish(item, published) if req.publish else False
        if not req.publish or (is_published and tier is not self.stack.publishing.target):
            # a published object is written behind too: the local copy outlives its Redis TTL
            queued = self.stack.placement.schedule_copy_down(meta.object_id, tier)
            if not queued and is_published and not durable:  # the queue is full: written now
                durable = await self.stack.placement.copy_down_now(meta.object_id, tier)
        return PutResult(ref, tier.name, is_published, durable)

    async def _publish(self, item: Stored, published: dict[int, StatetierError | None]) -> bool:
        """Written through to the cross-node tier; without one (tolerated) False, counted."""
        stack, meta, tier = self.stack, item.meta, item.tier
        target = stack.publishing.target
        if target is None:
            log.warning("put of %s asked to publish; no cross-node tier: stored locally only", meta.object_id.hex())
            stack.metrics.count_unpublished()
            stack.placement.schedule_copy_down(meta.object_id, tier)
            return False
        if tier is target:
            stack.placement.schedule_copy_down(meta.object_id, tier)
        elif item.index in published:  # copied with the rest of its batch
            error = published[item.index]
            if error is not None:
                raise error
        else:
            await self._copy(item, target)
        extra = stack.publishing.bytes_beside(meta.namespace)
        if extra is not None and extra is not tier:
            await self._copy(item, extra)  # descriptor+bytes: a Redis copy that outlives this daemon
        return True

    async def _store_durably(self, item: Stored) -> bool:
        """A copy in the durable tier now, not write-behind; False (the answer says so)
        when there is none or it cannot take the object."""
        stack, meta = self.stack, item.meta
        target = next((t for t in stack.tiers if t.is_durable), None)
        if target is None:
            return False
        try:
            if item.chunks is None or stack.tenancy.may_copy(item.tier.name, target.name, meta.object_id, meta.size):
                await self._copy(item, target)
        except StatetierError as exc:
            log.debug("durable copy of %s into %s failed: %s", meta.object_id.hex(), target.name, exc)
            return False
        return await target.contains(meta.object_id)

    async def _copy(self, item: Stored, target: Tier) -> None:
        stack, meta = self.stack, item.meta
        if item.chunks is None:  # it lives only in the arena: copied out under a lease
            await stack.placement.copy_between(meta.object_id, item.tier, target)
        else:
            await stack.placement.copy_object(item.tier, target, item.chunks, meta, room=Room.EVICT, charge=REQUIRED)
