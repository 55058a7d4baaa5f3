"""Placement: where a sealed object goes, and how objects move between tiers.

``Placement(tiers, metrics)`` over tiers ordered fastest first.

- ``store(chunks, meta, first=0)``  — into the highest tier from ``first`` down that has
  room; room is made by evicting that tier's LRU objects and *demoting* them to the next
  tier down (dropping only what no lower tier can take), one eviction per tier at a time;
  a victim a lower tier already holds (a write-behind copied it) is dropped without its
  bytes being copied out (``Tier.evict_sparing_copies``).
  Returns the tier used.
- ``prepare_all(tier, metas)`` — room for a batch of puts in one tier (one eviction for
  all of them): the store tickets of those that fit, in order.
- ``store_in(tier, chunks, meta)`` — a put's object into one given tier.
- ``begin_copy(source, target, meta, room=, charge=)`` → ``TierCopy`` — **the one routine every
  tier-to-tier copy starts with** (``daemon.engine.tier_copies``: the room policy, free
  room only or evict, and who pays, as arguments); ``copy_object(source, target, chunks,
  meta, room=, charge=)`` begins, writes and completes one; ``copy_calls`` counts them by
  (charge, source, target). Promotion, demotion, write-behind and batch copies
  (``daemon.engine.batch_copies``) all go through it.
- ``promote(source, lease, target, tenant=, delete_mark=)`` — a load's promotion: a
  ``Promotion`` holding a reservation in ``target`` taken from *free* room only (a load never
  evicts), or None (a delete runs or ended since the load began, a copy is already there, the
  tenant's quota, no room). The load path reads into it, classifies, and ends it with
  ``promotion.complete(ok, owner=, ttl=)`` (``daemon.engine.promotion``) → the lease on the
  promoted copy (None when not kept). With no free room the object is queued for the write-behind worker, which
  makes room by the tier's watermark policy (evicting and demoting) and promotes it then
  (the same copy with ``Room.EVICT``, charged to the same tenant).
- ``copy_down(state_id, source)``  — write-behind: a copy into the next persistent tier,
  queued (bounded) by ``schedule_copy_down`` (False: not queued, the queue is full; then
  ``copy_down_now`` makes it on the caller's time: a publish's backpressure) and run
  by the worker ``run_write_behind``, at low priority: before each copy it waits on
  ``yields_to`` (the peer server's ``quiet``: the pulls being answered, and those of what was
  just published, go first), until ``WRITE_BEHIND_YIELD_SECONDS`` after the copy was queued,
  so a steady stream of pulls and publishes delays each copy that long, never starves them;
  ``copy_between(state_id, source, target)`` — one copy read from ``source`` under a lease.

Every store is ``prepare_store`` → ``write`` → ``complete_store(success)`` with the
completion in ``finally``, so a cancelled move leaves nothing half visible.

Moves and deletes: every move (an eviction with its demotions, a write-behind copy, a
promotion) runs as a numbered *cycle* (``daemon.engine.cycles``). ``deleting(object_id)`` puts a
tombstone up for the length of a delete: no cycle starts a copy of a tombstoned object, and
``settle_moves()`` waits for every cycle begun before it, so a delete that sweeps the tiers,
settles, and sweeps again leaves no copy behind, whatever eviction was doing meanwhile;
``has_moves`` says whether any cycle is open (a load that found nothing settles the moves but the
loads' promotions, ``settle_relocations``, then looks
again: its object may be between two tiers). A load may hold a lease on a copy that a delete
removed meanwhile: ``delete_mark`` (taken when it begins) and ``deleted_since(object_id,
mark)`` say whether a delete of that object ended since, so it does not promote it back.

Tenant bytes follow the copies: ``tenancy`` (``daemon.engine.tenancy.Tenancy``) hears of every
copy (``copied``), move (``moved``), promotion (``charge``) and drop (``dropped``), and refuses
a copy past the tenant's quota in the target tier (``may_copy``, ``would_exceed``): such a
write-behind or promotion is skipped and such a demotion goes further down, or drops the
object (counted in ``dropped``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

from statetier.protocol.errors import CapacityError, InvalidRequest, NotFound, StatetierError
from statetier.protocol.lru import BoundedLru
from statetier.tiers.base import EvictedObject, Lease, ObjectMeta, Tier

from ..metrics import Metrics, NullMetrics
from .cycles import MoveCycles
from .promotion import Promotion
from .tier_copies import FOLLOWS, MOVES, Charge, ChargedTo, TierCopy, Room

log = logging.getLogger("statetier.placement")

#: Ended deletes remembered by object id (``deleted_since``); a load that began before more
#: than this many ended takes its object for deleted.
DELETES_REMEMBERED = 1 << 16
#: How long after it was queued a write-behind copy stops waiting for the pulls (``yields_to``).
WRITE_BEHIND_YIELD_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class _Queued:
    """One job of the write-behind worker: a copy of ``object_id`` down from ``source``, or,
    with ``promote_to``, a promotion up into it that found no free room on the load path."""

    object_id: bytes
    source: Tier
    promote_to: Tier | None = None
    tenant: str = ""
    queued_at: float = field(default_factory=time.monotonic)


class _NoTenants:
    """Placement without tenants (tests of placement alone): every copy is allowed."""

    def may_copy(self, src: str, dst: str, object_id: bytes, nbytes: int) -> bool:
        return True

    def would_exceed(self, tenant: str, tier: str, nbytes: int) -> bool:
        return False

    def charge(self, tenant: str, tier: str, object_id: bytes, nbytes: int) -> None: ...

    def copied(self, src: str, dst: str, object_id: bytes) -> None: ...

    def moved(self, src: str, dst: str, object_id: bytes) -> None: ...

    def dropped(self, tier: str, object_id: bytes) -> None: ...


class Placement:
    def __init__(self, tiers: Sequence[Tier], metrics: Metrics | NullMetrics | None = None, *,
                 write_behind_limit: int = 256,
                 write_behind_from: Sequence[Tier] = (), write_behind_to: Tier | None = None,
                 tenancy=None, yields_to: Callable[[float], Awaitable[bool]] | None = None) -> None:
        self.tiers = list(tiers)
        self.metrics = NullMetrics() if metrics is None else metrics
        self.tenancy = tenancy if tenancy is not None else _NoTenants()
        self._cycles = MoveCycles()
        self._tombstones: dict[bytes, int] = {}
        self._deletes_ended = 0
        self._ended_at: BoundedLru[bytes, int] = BoundedLru(DELETES_REMEMBERED)  # object id -> its delete's end
        self._eviction_locks: dict[int, asyncio.Lock] = {}
        self._queue: asyncio.Queue[_Queued] = asyncio.Queue(maxsize=max(1, write_behind_limit))
        self._write_behind_from = set(id(t) for t in write_behind_from)
        self._write_behind_to = write_behind_to
        self._yields_to = yields_to
        self.write_behind_yields = 0  # copies that waited for pulls to end first
        self.dropped = 0
        self.write_behind_skipped = 0
        self.copy_calls: Counter[tuple[str, str, str]] = Counter()  # (charge, source, target) -> begun

    def below(self, tier: Tier) -> list[Tier]:
        """The tiers under ``tier`` that hold bytes (a demotion's and a copy's targets)."""
        return [t for t in self.tiers[self.tiers.index(tier) + 1 :] if t.holds_bytes]

    async def store(self, chunks: Sequence, meta: ObjectMeta, first: int = 0, *,
                    skip: Sequence[Tier] = ()) -> Tier:
        last_error: StatetierError | None = None
        for tier in self.tiers[first:]:
            if tier in skip or not tier.holds_bytes:
                continue
            try:
                await self.store_in(tier, chunks, meta)
                return tier
            except CapacityError as exc:
                last_error = exc
        raise last_error or CapacityError("no tier can take the object")

    async def store_in(self, tier: Tier, chunks: Sequence, meta: ObjectMeta) -> None:
        started = time.perf_counter()
        ticket = await self.prepare_with_room(tier, meta)
        ok = False
        try:
            await tier.write(ticket, chunks)
            ok = True
        finally:
            await tier.complete_store(ticket, ok)
        self.metrics.observe_op(tier.name, meta.kind.name.lower(), "store", meta.size, time.perf_counter() - started)

    # ---------------------------------------------------------------- a load's promotion

    async def promote(self, source: Tier, lease: Lease, target: Tier, *, tenant: str,
                      delete_mark: int) -> Promotion | None:
        """Room in ``target`` for the copy ``lease`` pins in ``source``, taken from free room
        only, inside a cycle that ``Promotion.complete`` ends; None when it may not be
        promoted now: ``target`` is not above ``source``, a delete of it runs or ended since
        ``delete_mark`` (its lease still serves the load; a promotion would bring a deleted
        object back), a copy is already there (unjudged: never served in place of this one),
        the tenant's quota. With no free room the object is queued for the write-behind
        worker (``_promote_later``), which makes room by the tier's watermarks."""
        if target is source or self.tiers.index(target) > self.tiers.index(source):
            return None
        meta = lease.meta
        cycle = self._cycles.begin_promotion()
        copy: TierCopy | None = None
        try:
            if not (self.is_deleting(meta.object_id) or self.deleted_since(meta.object_id, delete_mark)
                    or await target.contains(meta.object_id)):
                copy = await self.begin_copy(source, target, meta, room=Room.FREE, charge=ChargedTo(tenant))
        except CapacityError:
            self._queue_nowait(_Queued(meta.object_id, source, promote_to=target, tenant=tenant))
        except StatetierError as exc:  # a concurrent promotion of it won, the tier failed
            log.debug("promotion of %s into %s skipped: %s", meta.object_id.hex(), target.name, exc)
        if copy is None:
            await cycle.end()
            return None
        return Promotion(copy, cycle)

    # ---------------------------------------------------------------- the one copy routine

    async def begin_copy(self, source: Tier, target: Tier, meta: ObjectMeta, *, room: Room,
                         charge: Charge) -> TierCopy | None:
        """A reservation in ``target`` for ``meta``'s object from ``source``: taken from free
        room (``Room.FREE``, else ``CapacityError``) or made by evicting (``Room.EVICT``);
        None when ``charge`` refuses it (the tenant's quota there). ``InvalidRequest`` when
        ``target`` holds it already. The caller writes ``copy.ticket`` and completes it
        (``TierCopy.complete``: the store, the charge booked and the store observed, once)."""
        self.copy_calls[(charge.name, source.name, target.name)] += 1
        if not charge.allows(self.tenancy, source.name, target.name, meta):
            return None
        if room is Room.EVICT:
            ticket = await self.prepare_with_room(target, meta)
        else:
            ticket = await target.prepare_store(meta)
        return TierCopy(source, target, ticket, charge, self.tenancy, self.metrics)

    async def copy_object(self, source: Tier, target: Tier, chunks: Sequence, meta: ObjectMeta, *,
                          room: Room, charge: Charge) -> bool:
        """``begin_copy``, ``chunks`` written, completed; False when ``charge`` refused it."""
        copy = await self.begin_copy(source, target, meta, room=room, charge=charge)
        if copy is None:
            return False
        ok = False
        try:
            await target.write(copy.ticket, chunks)
            ok = True
        finally:
            await copy.complete(ok)
        return True

    async def undo_if_source_lost(self, source: Tier, target: Tier, object_id: bytes) -> None:
        """A copy of an object removed from ``source`` while the copy ran (a damaged copy
        dropped; the copy's lease rules out eviction) must not outlive it."""
        if not await source.contains(object_id):
            await target.delete(object_id)
            self.tenancy.dropped(target.name, object_id)

    # ---------------------------------------------------------------- moves vs deletes

    def cycle(self) -> contextlib.AbstractAsyncContextManager[None]:
        """One move (an eviction and its demotions, a copy): ``settle_moves`` waits for it."""
        return self._cycles.cycle()

    @contextlib.asynccontextmanager
    async def deleting(self, object_id: bytes) -> AsyncIterator[None]:
        """A tombstone for the length of a delete: no cycle copies the object meanwhile."""
        self._tombstones[object_id] = self._tombstones.get(object_id, 0) + 1
        try:
            yield
        finally:
            left = self._tombstones.pop(object_id) - 1
            if left:
                self._tombstones[object_id] = left
            self._deletes_ended += 1
            self._ended_at.put(object_id, self._deletes_ended)

    def is_deleting(self, object_id: bytes) -> bool:
        return object_id in self._tombstones

    @property
    def delete_mark(self) -> int:
        """How many deletes have ended: taken when a load begins, asked with ``deleted_since``."""
        return self._deletes_ended

    def deleted_since(self, object_id: bytes, mark: int) -> bool:
        """Whether a delete of ``object_id`` ended after ``delete_mark`` was ``mark`` (True too
        when so many deletes ended since that this one may have been forgotten)."""
        ended = self._ended_at.peek(object_id)
        if ended is not None:
            return ended > mark
        return self._deletes_ended - mark > DELETES_REMEMBERED

    @property
    def has_moves(self) -> bool:
        return self._cycles.has_moves

    async def settle_moves(self) -> None:
        """Wait until every cycle that began before this call has ended."""
        await self._cycles.settle()

    @property
    def has_relocations(self) -> bool:
        return self._cycles.has_relocations

    async def settle_relocations(self) -> None:
        """Wait until every move but the loads' promotions begun before this call has ended:
        what may hold an object between two tiers (``MoveCycles.settle_relocations``)."""
        await self._cycles.settle_relocations()

    async def prepare_all(self, tier: Tier, metas: list[ObjectMeta]) -> list:
        """Room for a batch in ``tier``: ``prepare_with_room`` of each meta in order, with one
        eviction for all their bytes (and one more when they do not fit). The tickets of the
        leading metas that got room: fewer than ``metas`` when the tier ran out."""
        await self._evict_and_demote(tier, sum(meta.size for meta in metas))
        tickets: list = []
        evicted_again = False
        for n, meta in enumerate(metas):
            try:
                tickets.append(await tier.prepare_store(meta))
            except CapacityError:
                if evicted_again or not await self._evict_and_demote(tier, sum(m.size for m in metas[n:])):
                    break
                evicted_again = True
                try:
                    tickets.append(await tier.prepare_store(meta))
                except CapacityError:
                    break
        return tickets

    async def make_room(self, tier: Tier, need_bytes: int) -> bool:
        """Evict (and demote) what ``need_bytes`` more need in ``tier``, as a store does
        first; False when nothing could be evicted (``daemon.engine.batch_copies``)."""
        return await self._evict_and_demote(tier, need_bytes)

    async def prepare_with_room(self, tier: Tier, meta: ObjectMeta):
        # Tiers evict only when asked: above the high watermark (counting this object)
        # ``evict`` brings usage down to the low one and hands back what it removed.
        await self._evict_and_demote(tier, meta.size)
        try:
            return await tier.prepare_store(meta)
        except CapacityError:
            if not await self._evict_and_demote(tier, meta.size):
                raise
            return await tier.prepare_store(meta)

    async def _evict_and_demote(self, tier: Tier, need_bytes: int) -> bool:
        # One eviction per tier at a time: puts that need room at once would each copy out
        # the same victims (a whole watermark band each, in memory outside the byte budget);
        # the next one finds the room already made.
        lock = self._eviction_locks.setdefault(id(tier), asyncio.Lock())
        lower = self.below(tier)
        # with no tier below, a victim's bytes have nowhere to go: none is copied out
        spared = (lambda oid: self._is_held_below(lower, oid)) if lower else _nowhere_to_go
        async with self.cycle(), lock:
            evicted = await tier.evict_sparing_copies(need_bytes, spared)
            if evicted:
                await self.demote(tier, evicted)
        return bool(evicted)

    async def demote(self, source: Tier, evicted: list[EvictedObject]) -> None:
        """Move what ``source`` evicted to the next tier down that takes it (inside a cycle).
        (The tier counts its evictions itself: ``statetier_evictions_total``.)"""
        lower = self.below(source)
        for item in evicted:
            oid = item.meta.object_id
            if self.is_deleting(oid):
                self.tenancy.dropped(source.name, oid)
                continue
            if not lower:  # the last tier that holds bytes: what it evicts is dropped
                self.dropped += 1
                self.tenancy.dropped(source.name, oid)
                log.info("dropped %s: no lower tier could take it", oid.hex())
                continue
            holder = await self._holder_below(lower, oid)
            if holder is not None:
                self.tenancy.dropped(source.name, oid)
                continue
            if item.blob is None:  # its copy below went away while the eviction ran
                self.dropped += 1
                self.tenancy.dropped(source.name, oid)
                log.info("dropped %s: its copy below left during its eviction", oid.hex())
                continue
            if not await self._demote_one(source, lower, item):
                self.dropped += 1
                self.tenancy.dropped(source.name, oid)
                log.info("dropped %s: no lower tier could take it", oid.hex())

    async def _is_held_below(self, lower: list[Tier], object_id: bytes) -> bool:
        return await self._holder_below(lower, object_id) is not None

    async def _holder_below(self, lower: list[Tier], object_id: bytes) -> Tier | None:
        for tier in lower:
            try:
                if await tier.contains(object_id):
                    return tier
            except StatetierError:
                continue
        return None

    async def _demote_one(self, source: Tier, lower: list[Tier], item: EvictedObject) -> bool:
        """Into the first tier below that takes it within the tenant's quota (moved and
        counted); False when none did."""
        for tier in lower:
            try:
                if await self.copy_object(source, tier, [item.blob], item.meta, room=Room.EVICT, charge=MOVES):
                    return True
            except InvalidRequest:  # already present there (a concurrent copy won): moved all the same
                MOVES.book(self.tenancy, self.metrics, source.name, tier.name, item.meta)
                return True
            except StatetierError as exc:
                log.debug("demotion of %s into %s failed: %s", item.meta.object_id.hex(), tier.name, exc)
        return False

    # ---------------------------------------------------------------- write-behind

    def schedule_copy_down(self, object_id: bytes, source: Tier) -> bool:
        """Queued for the write-behind worker (True), or nothing to copy down (True); False
        when the queue is full (counted as skipped: eviction demotes it instead)."""
        if self._write_behind_to is None or id(source) not in self._write_behind_from:
            return True
        return self._queue_nowait(_Queued(object_id, source))

    def _queue_nowait(self, job: _Queued) -> bool:
        try:
            self._queue.put_nowait(job)
            return True
        except asyncio.QueueFull:
            self.write_behind_skipped += 1  # eviction will demote it instead; a later load promotes it
            return False

    async def run_write_behind(self) -> None:
        """The worker: each queued write-behind copy, and each promotion a load found no free
        room for (room made here, by the target's watermarks, then the copy)."""
        while True:
            job = await self._queue.get()
            try:
                if job.promote_to is None:
                    await self._yield(job)
                    await self.copy_down(job.object_id, job.source)
                else:
                    await self._promote_later(job)
            except asyncio.CancelledError:
                raise
            except StatetierError as exc:
                log.debug("write-behind of %s skipped: %s", job.object_id.hex(), exc)
            except Exception:  # a worker must survive one bad object
                log.exception("write-behind of %s failed", job.object_id.hex())
            finally:
                self._queue.task_done()

    async def _yield(self, job: _Queued) -> None:
        """Low priority: the pulls being answered end first, until ``WRITE_BEHIND_YIELD_SECONDS``
        after the copy was queued (a steady stream of pulls delays each copy that long, never
        the queue's copies one after the other)."""
        if self._yields_to is not None and not await self._yields_to(0):
            self.write_behind_yields += 1
            left = job.queued_at + WRITE_BEHIND_YIELD_SECONDS - time.monotonic()
            if left > 0:
                await self._yields_to(left)

    async def flush_write_behind(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._queue.join(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def copy_down(self, object_id: bytes, source: Tier) -> None:
        target = self._write_behind_to
        if target is None or await target.contains(object_id):
            return
        await self.copy_between(object_id, source, target, missing_ok=True)

    async def copy_down_now(self, object_id: bytes, source: Tier) -> bool:
        """The write-behind copy made now (its queue was full): True when the tier it went
        to is durable and holds the object."""
        target = self._write_behind_to
        if target is None:
            return False
        try:
            await self.copy_down(object_id, source)
        except StatetierError as exc:
            log.debug("copy of %s into %s failed: %s", object_id.hex(), target.name, exc)
            return False
        return target.is_durable and await target.contains(object_id)

    async def _promote_later(self, job: _Queued) -> None:
        """A promotion a load found no free room for: room made in the target by its
        watermarks (evicting and demoting, as a put does), then the copy, charged to the
        tenant whose load asked for it. Its bytes are read without the pass over the
        payload, as the load path reads them: every load of the promoted copy is verified
        where it lands."""
        target = job.promote_to
        assert target is not None  # only a promotion's job names one
        if await target.contains(job.object_id):
            return
        await self._copy_leased(job.object_id, job.source, target, ChargedTo(job.tenant), verify=False,
                                missing_ok=True)

    async def copy_between(self, object_id: bytes, source: Tier, target: Tier, *, missing_ok: bool = False) -> None:
        """Copy one object from ``source`` into ``target`` under a lease on the source (its
        bytes verified as read), the source copy's tenant charged in ``target``; a copy past
        the tenant's quota there is skipped."""
        await self._copy_leased(object_id, source, target, FOLLOWS, verify=True, missing_ok=missing_ok)

    async def _copy_leased(self, object_id: bytes, source: Tier, target: Tier, charge: Charge, *, verify: bool,
                           missing_ok: bool) -> None:
        async with self.cycle():
            if self.is_deleting(object_id):
                return
            try:
                lease = await source.prepare_load(object_id, owner="copy")
            except NotFound:
                if missing_ok:
                    return
                raise
            try:
                copy = await self.begin_copy(source, target, lease.meta, room=Room.EVICT, charge=charge)
                if copy is None:
                    self.write_behind_skipped += 1
                    return
                ok = False
                try:
                    await target.write(copy.ticket, [await source.read(lease, verify=verify)])
                    ok = True
                finally:
                    await copy.complete(ok)
                await self.undo_if_source_lost(source, target, object_id)
            except InvalidRequest:
                pass  # already there
            finally:
                await source.complete_load(lease)

    @property
    def write_behind_pending(self) -> int:
        return self._queue.qsize()


async def _nowhere_to_go(object_id: bytes) -> bool:
    """An eviction's ``is_held_below`` from the lowest tier that holds bytes: every victim
    leaves without its bytes being copied out (there is no tier to demote it to)."""
    return True
