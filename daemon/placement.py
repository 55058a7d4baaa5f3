"""Placement: where a sealed object goes, and how objects move between tiers.

``Placement(tiers, metrics)`` over tiers ordered fastest first.

- ``store(chunks, meta, first=0)``  — into the highest tier from ``first`` down that has
  room; room is made by evicting that tier's LRU objects and *demoting* them to the next
  tier down (dropping only what no lower tier can take), one eviction per tier at a time.
  Returns the tier used.
- ``store_in(tier, chunks, meta)`` — into one given tier (publish, promotion).
- ``copy_down(state_id, source)``  — write-behind: a copy into the next persistent tier,
  queued (bounded) by ``schedule_copy_down`` and run by the worker ``run_write_behind``.
- ``wait_moves(state_id)``          — waits for the demotions and copies of one object in
  flight; True if there were any. A delete calls it and deletes again, so that no copy
  that was on its way lands (and is made durable) after the delete was acknowledged.

Every store is ``prepare_store`` → ``write`` → ``complete_store(success)`` with the
completion in ``finally``, so a cancelled move leaves nothing half visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Sequence

from statetier.protocol.errors import CapacityError, InvalidRequest, NotFound, StatetierError
from statetier.tiers.base import EvictedObject, ObjectMeta, Tier

log = logging.getLogger("statetier.placement")


class Placement:
    def __init__(self, tiers: Sequence[Tier], metrics=None, *, write_behind_limit: int = 256,
                 write_behind_from: Sequence[Tier] = (), write_behind_to: Tier | None = None) -> None:
        self.tiers = list(tiers)
        self.metrics = metrics
        self._queue: asyncio.Queue[tuple[bytes, Tier]] = asyncio.Queue(maxsize=max(1, write_behind_limit))
        self._write_behind_from = set(id(t) for t in write_behind_from)
        self._write_behind_to = write_behind_to
        self.dropped = 0
        self.write_behind_skipped = 0
        self._moves: dict[bytes, list[asyncio.Future]] = {}  # object_id → its moves in flight
        self._eviction_locks: dict[int, asyncio.Lock] = {}

    def below(self, tier: Tier) -> list[Tier]:
        return self.tiers[self.tiers.index(tier) + 1 :]

    async def store(self, chunks: Sequence, meta: ObjectMeta, first: int = 0, *,
                    skip: Sequence[Tier] = ()) -> Tier:
        last_error: StatetierError | None = None
        for tier in self.tiers[first:]:
            if tier in skip:
                continue
            try:
                await self.store_in(tier, chunks, meta)
                return tier
            except CapacityError as exc:
                last_error = exc
        raise last_error or CapacityError("no tier can take the object")

    async def store_in(self, tier: Tier, chunks: Sequence, meta: ObjectMeta) -> None:
        started = time.perf_counter()
        ticket = await self._prepare_with_room(tier, meta)
        ok = False
        try:
            await tier.write(ticket, chunks)
            ok = True
        finally:
            await tier.complete_store(ticket, ok)
        if self.metrics is not None:
            self.metrics.observe_op(tier.name, meta.kind.name.lower(), "store", meta.size,
                                    time.perf_counter() - started)

    async def _prepare_with_room(self, tier: Tier, meta: ObjectMeta):
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
        async with lock:
            evicted = await tier.evict(need_bytes)
            if evicted:
                await self.demote(tier, evicted)
        return bool(evicted)

    async def demote(self, source: Tier, evicted: list[EvictedObject]) -> None:
        if self.metrics is not None:
            self.metrics.count_eviction(source.name, len(evicted))
        lower = self.below(source)
        with contextlib.ExitStack() as moving:  # registered before the first await
            for item in evicted:
                moving.enter_context(self._moving(item.meta.object_id))
            for item in evicted:
                await self._demote_one(source, lower, item)

    async def _demote_one(self, source: Tier, lower: list[Tier], item: EvictedObject) -> None:
        if await self._held_below(lower, item.meta.object_id):
            return
        target = await self._demote_into(lower, item)
        if target is None:
            self.dropped += 1
            log.info("dropped %s: no lower tier could take it", item.meta.object_id.hex())
        elif self.metrics is not None:
            self.metrics.count_demotion(source.name, target.name)

    async def _held_below(self, lower: list[Tier], object_id: bytes) -> bool:
        for tier in lower:
            try:
                if await tier.contains(object_id):
                    return True
            except StatetierError:
                continue
        return False

    @contextlib.contextmanager
    def _moving(self, object_id: bytes):
        done = asyncio.get_running_loop().create_future()
        self._moves.setdefault(object_id, []).append(done)
        try:
            yield
        finally:
            done.set_result(None)
            moves = self._moves[object_id]
            moves.remove(done)
            if not moves:
                del self._moves[object_id]

    async def wait_moves(self, object_id: bytes) -> bool:
        moves = list(self._moves.get(object_id, ()))
        if moves:
            await asyncio.wait(moves)
        return bool(moves)

    async def _demote_into(self, lower: list[Tier], item: EvictedObject) -> Tier | None:
        for tier in lower:
            try:
                await self.store_in(tier, [item.blob], item.meta)
                return tier
            except InvalidRequest:
                return tier  # already present there (a concurrent copy won)
            except StatetierError as exc:
                log.debug("demotion of %s into %s failed: %s", item.meta.object_id.hex(), tier.name, exc)
        return None

    # ---------------------------------------------------------------- write-behind

    def schedule_copy_down(self, object_id: bytes, source: Tier) -> None:
        if self._write_behind_to is None or id(source) not in self._write_behind_from:
            return
        try:
            self._queue.put_nowait((object_id, source))
        except asyncio.QueueFull:
            self.write_behind_skipped += 1  # eviction will demote it instead

    async def run_write_behind(self) -> None:
        while True:
            object_id, source = await self._queue.get()
            try:
                await self.copy_down(object_id, source)
            except asyncio.CancelledError:
                raise
            except StatetierError as exc:
                log.debug("write-behind of %s skipped: %s", object_id.hex(), exc)
            except Exception:  # a worker must survive one bad object
                log.exception("write-behind of %s failed", object_id.hex())
            finally:
                self._queue.task_done()

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

    async def copy_between(self, object_id: bytes, source: Tier, target: Tier, *, missing_ok: bool = False) -> None:
        """Copy one object from ``source`` into ``target`` under a lease on the source."""
        with self._moving(object_id):
            await self._copy_leased(object_id, source, target, missing_ok)

    async def _copy_leased(self, object_id: bytes, source: Tier, target: Tier, missing_ok: bool) -> None:
        try:
            lease = await source.prepare_load(object_id, owner="copy")
        except NotFound:
            if missing_ok:
                return
            raise
        try:
            blob = await source.read(lease)
            await self.store_in(target, [blob], lease.meta)
            if not await source.contains(object_id):
                # deleted while the copy ran (our lease keeps it from eviction, so nothing
                # else removed it): the copy must not outlive the delete
                await target.delete(object_id)
        except InvalidRequest:
            pass  # already there
        finally:
            await source.complete_load(lease)

    @property
    def write_behind_pending(self) -> int:
        return self._queue.qsize()

