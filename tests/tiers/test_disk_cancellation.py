"""Cancellation of the disk tier at every point where it awaits an executor job.

``GatedExecutor`` holds each job in turn and ``cancel_at_each_job`` cancels the operation
while that job is held, until the operation finishes without one. A store cancelled at any
point leaves nothing visible (and the tier keeps storing); loads, evictions and compactions
cancelled at any point leave the tier sound; concurrent stores share one durable commit.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from statetier.tiers.disk.stores import BUFFERED_BYTES
from tests.support.disk_crash_writer import load, store
from tests.support.disk_files import objects
from tests.support.waiting import eventually


class GatedExecutor(ThreadPoolExecutor):
    """A real thread pool that holds every job after the first ``allow`` until ``open()``."""

    def __init__(self) -> None:
        super().__init__(4)
        self.allow = 1 << 30
        self.submitted = 0
        self._gate = threading.Event()
        self.held = asyncio.Event()

    def arm(self, allow: int) -> None:
        self.allow, self.submitted = allow, 0
        self._gate.clear()
        self.held = asyncio.Event()

    def open(self) -> None:
        self.allow = 1 << 30
        self._gate.set()

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        if self.submitted <= self.allow:
            return super().submit(fn, *args, **kwargs)
        self.held.set()
        gate = self._gate
        return super().submit(lambda: (gate.wait(), fn(*args, **kwargs))[1])


async def cancel_at_each_job(executor: GatedExecutor, make_coro, check) -> int:
    """Run ``make_coro()`` once per executor job it submits, cancelling it while that job
    is held; ``check(finished)`` then inspects the tier. Returns the number of points."""
    for point in range(50):
        executor.arm(point)
        task = asyncio.create_task(make_coro())
        held = asyncio.create_task(executor.held.wait())
        await asyncio.wait({task, held}, return_when=asyncio.FIRST_COMPLETED)
        held.cancel()
        finished = task.done()
        if not finished:
            task.cancel()
        executor.open()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await check(finished)
        if finished:
            return point
    raise AssertionError("the coroutine never finished")


@pytest.mark.parametrize(("size", "jobs"), [(3000, 1), (BUFFERED_BYTES + 1000, 2)], ids=["buffered", "written"])
async def test_a_store_cancelled_at_any_point_leaves_nothing_visible(open_disk, tmp_path, size, jobs):
    executor = GatedExecutor()
    tier = await open_disk(executor=executor, segment_bytes=4 << 20)
    pending = iter(objects(20, size=size))
    current = [None]
    outcomes = []

    async def one_store():
        meta, blob = current[0] = next(pending)
        await store(tier, meta, blob)

    async def check(finished: bool) -> None:
        meta, blob = current[0]
        outcomes.append(finished)
        assert await tier.contains(meta.object_id) is finished
        stats = tier.stats()
        assert (stats.inflight, stats.extra["reserved_bytes"]) == (0, 0)
        if finished:
            assert await load(tier, meta.object_id) == blob

    points = await cancel_at_each_job(executor, one_store, check)
    assert points >= jobs and outcomes == [False] * points + [True]  # (write,) commit, … then done
    await tier.close()
    executor.shutdown()

    reopened = await open_disk(segment_bytes=4 << 20)
    assert [m.object_id async for m in reopened.iter_objects()] == [current[0][0].object_id]


async def test_loads_evictions_and_compactions_cancelled_at_any_point_leave_the_tier_sound(open_disk):
    executor = GatedExecutor()
    batch = objects(12, size=6000)
    tier = await open_disk(executor=executor, capacity=12 * 6400, segment_bytes=20_000)
    for meta, blob in batch:
        await store(tier, meta, blob)
    for meta, _ in batch[::2]:
        await tier.delete(meta.object_id)
    survivors = {meta.object_id: blob for meta, blob in batch[1::2]}

    async def check(finished: bool) -> None:
        assert tier.stats().leases == 0
        for object_id in [oid for oid in survivors if not await tier.contains(oid)]:
            del survivors[object_id]  # evicted: an eviction removes before it reads
        for object_id, blob in survivors.items():
            assert await load(tier, object_id) == blob

    async def one_load():
        object_id = next(iter(survivors))
        lease = await tier.prepare_load(object_id)
        try:
            assert bytes(await tier.read(lease)) == survivors[object_id]
        finally:
            await tier.complete_load(lease)

    assert await cancel_at_each_job(executor, one_load, check) >= 1
    assert await cancel_at_each_job(executor, tier.compact, check) >= 1
    assert tier.stats().bytes_reclaimed > 0
    assert await cancel_at_each_job(executor, lambda: tier.evict(40_000), check) >= 1
    await tier.close()
    executor.shutdown()


async def test_concurrent_stores_share_one_durable_index_commit(open_disk):
    executor = GatedExecutor()
    tier = await open_disk(executor=executor)
    batch = objects(16, size=2000)
    executor.arm(0)  # small objects are written by the commit itself: the first commit is held

    stores = [asyncio.create_task(store(tier, meta, blob)) for meta, blob in batch]
    try:
        await executor.held.wait()
        extra = lambda: tier.stats().extra  # noqa: E731
        await eventually(lambda: extra()["index_ops"] + extra()["index_ops_waiting"] >= 16,
                         "every store in the held batch or queued behind it", timeout=30)
    finally:
        executor.open()
    await asyncio.gather(*stores)

    extra = tier.stats().extra
    assert extra["index_ops"] == 16 and extra["index_batches"] <= 2  # the held one and one more
    for meta, blob in batch:
        assert await load(tier, meta.object_id) == blob
    await tier.close()
    executor.shutdown()
