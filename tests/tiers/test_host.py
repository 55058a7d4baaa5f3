"""HostTier on a real memfd arena: lifecycle, cancellation, eviction, leases, and
defragmentation while readers hold leases. The arena as other processes see it (mapping
it, the sealed fd, the ``/dev/shm`` fallback, pinning, close) is in ``test_host_arena.py``."""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from statetier.protocol.errors import CapacityError, InvalidRequest, LeaseError, NotFound
from statetier.protocol.sealed import open_sealed
from statetier.tiers.memory.host import HostTier, HostTierOptions
from statetier.tiers.memory.records import PendingStore
from tests.support.host_tier import MIB, tier  # noqa: F401  (a fixture, used by name)
from tests.support.tier_contract import (
    KEYRING,
    assert_cancelled_store_leaves_nothing,
    assert_invisible,
    assert_read_view_released,
    assert_visible,
    fragment,
    load,
    make_object,
    store,
)

KIB = 1024
put, read_bytes = store, load  # the shared store/load steps of the contract suite


# ---------------------------------------------------------------------------- lifecycle


async def test_an_object_is_visible_only_after_complete_store(tier: HostTier) -> None:
    meta, blob = make_object(10_000)
    ticket = await tier.prepare_store(meta)
    await tier.write(ticket, [blob])
    await assert_invisible(tier, meta)
    assert tier.stats().bytes_used == meta.size  # the reservation counts
    await tier.complete_store(ticket, True)
    await assert_visible(tier, meta)
    await assert_read_view_released(tier, meta, blob, KEYRING)
    stats = tier.stats()
    assert (stats.objects, stats.bytes_used, stats.leases, stats.inflight) == (1, meta.size, 0, 0)


async def test_zero_copy_store_fills_the_arena_in_place(tier: HostTier) -> None:
    meta, blob = make_object(50_000)
    ticket = await tier.prepare_store(meta)
    assert isinstance(ticket.location, PendingStore) and len(ticket.view) == meta.size
    offset = ticket.location.offset
    ticket.view[:] = blob  # what a client does through its own mapping
    await tier.complete_store(ticket, True)
    assert ticket.view is None
    assert bytes(tier.arena_view[offset : offset + meta.size]) == blob
    assert await read_bytes(tier, meta.object_id) == blob


async def test_failed_store_leaves_nothing_and_frees_its_reservation(tier: HostTier) -> None:
    meta, blob = make_object(10_000)
    ticket = await tier.prepare_store(meta)
    await tier.write(ticket, [blob])
    await tier.complete_store(ticket, False)
    await tier.complete_store(ticket, False)  # twice is harmless
    with pytest.raises(InvalidRequest):
        await tier.complete_store(ticket, True)
    assert not await tier.contains(meta.object_id)
    stats = tier.stats()
    assert (stats.objects, stats.bytes_used, stats.inflight, stats.extra["extent_bytes_allocated"]) == (0, 0, 0, 0)
    await put(tier, meta, blob)  # the id is free again
    assert await read_bytes(tier, meta.object_id) == blob


async def test_storing_a_present_or_pending_id_is_refused(tier: HostTier) -> None:
    meta, blob = make_object(1000)
    ticket = await tier.prepare_store(meta)
    with pytest.raises(InvalidRequest):
        await tier.prepare_store(meta)
    await tier.write(ticket, [blob])
    await tier.complete_store(ticket, True)
    with pytest.raises(InvalidRequest):
        await tier.prepare_store(meta)


async def test_overlong_and_partial_writes_are_refused(tier: HostTier) -> None:
    meta, blob = make_object(1000)
    ticket = await tier.prepare_store(meta)
    with pytest.raises(InvalidRequest):
        await tier.write(ticket, [blob, b"x"])
    await tier.write(ticket, [blob[:100]])
    await tier.write(ticket, [blob[100:200]])  # writes append
    with pytest.raises(InvalidRequest):
        await tier.complete_store(ticket, True)  # 200 of the bytes: never visible
    assert not await tier.contains(meta.object_id)
    assert tier.stats().extra["extent_bytes_allocated"] == 0


async def test_capacity_error_counts_reservations_in_progress() -> None:
    async with HostTier(HostTierOptions(256 * KIB, pin_memory=False)) as tier:
        first, _ = make_object(150 * KIB)
        second, _ = make_object(150 * KIB)
        ticket = await tier.prepare_store(first)
        with pytest.raises(CapacityError) as caught:
            await tier.prepare_store(second)
        assert caught.value.detail["need"] == second.size
        await tier.complete_store(ticket, False)
        await tier.complete_store(await tier.prepare_store(second), False)
        huge, _ = make_object(300 * KIB)
        with pytest.raises(CapacityError):
            await tier.prepare_store(huge)


async def test_large_writes_and_reads_go_through_the_executor() -> None:
    async with HostTier(HostTierOptions(16 * MIB, pin_memory=False, inline_copy_bytes=64 * KIB)) as tier:
        meta, blob = make_object(3 * MIB)
        await put(tier, meta, blob)  # a bytes header chunk and a read-only memoryview payload
        assert await read_bytes(tier, meta.object_id) == blob
        lease = await tier.prepare_load(meta.object_id)
        dest = bytearray(meta.size + 10)
        assert bytes(await tier.read(lease, into=memoryview(dest))) == blob
        assert dest[: meta.size] == blob
        with pytest.raises(InvalidRequest):
            await tier.read(lease, into=memoryview(bytearray(10)))
        with pytest.raises(InvalidRequest):
            await tier.read(lease, into=memoryview(bytes(meta.size)))
        await tier.complete_load(lease)


# ---------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("where", ["before_write", "write_queued", "write_copying", "after_write"])
async def test_a_cancelled_store_leaves_nothing_and_returns_its_space(where: str) -> None:
    # the copy must still run 2 ms after it started (``store_then_cancel``): 12 MiB copied in
    # under 2 ms on a quiet machine, so the store finished before the cancel arrived
    size = 192 * MIB if where == "write_copying" else 12 * MIB

    def open_tier(executor) -> HostTier:
        return HostTier(HostTierOptions(size + 4 * MIB, pin_memory=False, inline_copy_bytes=0), executor=executor)

    await assert_cancelled_store_leaves_nothing(open_tier, make_object, size, where)


# ---------------------------------------------------------------------------- eviction


async def test_evict_returns_least_recently_used_unleased_objects_with_their_bytes() -> None:
    objects = {name: make_object(7_600) for name in "ABCDEFGH"}
    capacity = 10 * 8192  # 8 objects of ~7.9 KB fill 77 %; the low watermark holds 5
    async with HostTier(HostTierOptions(capacity, pin_memory=False, high_watermark=0.9, low_watermark=0.55)) as tier:
        for meta, blob in objects.values():
            await put(tier, meta, blob)
        assert await tier.evict(0) == []  # under the high watermark: nothing
        for name in "BD":  # loading refreshes: B and D become most recent
            await read_bytes(tier, objects[name][0].object_id)
        held = await tier.prepare_load(objects["C"][0].object_id, owner="reader")  # leased: never evicted
        evicted = await tier.evict(need_bytes=12_000)  # over 90 % with it; evict down to 55 %
        names = {meta.object_id: name for name, (meta, _) in objects.items()}
        assert [names[e.meta.object_id] for e in evicted] == ["A", "E", "F", "G"]
        for item in evicted:
            assert bytes(item.blob) == objects[names[item.meta.object_id]][1]
            assert not await tier.contains(item.meta.object_id)
        assert [names[m.object_id] async for m in tier.iter_objects()] == ["H", "B", "D", "C"]
        assert tier.stats().evictions == 4
        assert bytes(await tier.read(held)) == objects["C"][1]
        await tier.complete_load(held)


async def test_evicting_large_objects_copies_them_out_in_the_executor() -> None:
    async with HostTier(HostTierOptions(8 * MIB, pin_memory=False, high_watermark=0.5, low_watermark=0.1,
                                        inline_copy_bytes=64 * KIB)) as tier:
        objects = [make_object(1 * MIB) for _ in range(4)]
        for meta, blob in objects:
            await put(tier, meta, blob)
        evicted = await tier.evict(need_bytes=2 * MIB)
        assert [e.meta for e in evicted] == [meta for meta, _ in objects]
        assert [bytes(e.blob) for e in evicted] == [blob for _, blob in objects]
        assert tier.stats().extra["extent_bytes_allocated"] == 0


async def test_eviction_leaves_out_the_bytes_of_victims_a_lower_tier_already_holds() -> None:
    objects = {name: make_object(1 * MIB) for name in "ABCD"}
    below = {objects[name][0].object_id for name in "AC"}  # what a write-behind already copied down
    asked = []

    async def is_held_below(object_id: bytes) -> bool:
        asked.append(object_id)
        return object_id in below

    async with HostTier(HostTierOptions(8 * MIB, pin_memory=False, high_watermark=0.5, low_watermark=0.1,
                                        inline_copy_bytes=64 * KIB)) as tier:
        for meta, blob in objects.values():
            await put(tier, meta, blob)
        evicted = await tier.evict_sparing_copies(2 * MIB, is_held_below)
        names = {meta.object_id: name for name, (meta, _) in objects.items()}
        assert [names[e.meta.object_id] for e in evicted] == ["A", "B", "C", "D"]
        assert [names[oid] for oid in asked] == ["A", "B", "C", "D"]
        assert [e.blob is None for e in evicted] == [True, False, True, False]
        assert bytes(evicted[1].blob) == objects["B"][1] and bytes(evicted[3].blob) == objects["D"][1]
        assert tier.stats().extra["extent_bytes_allocated"] == 0
        assert tier.stats().evictions == 4


# ---------------------------------------------------------------------------- leases


async def test_an_expired_lease_cannot_read(clock) -> None:
    async with HostTier(HostTierOptions(1 * MIB, pin_memory=False, lease_ttl=0.05, clock=clock)) as tier:
        meta, blob = make_object(1000)
        await put(tier, meta, blob)
        lease = await tier.prepare_load(meta.object_id)
        fresh = await tier.prepare_load(meta.object_id, ttl=60)
        clock.advance(0.1)
        with pytest.raises(LeaseError):
            await tier.read(lease)
        assert bytes(await tier.read(fresh)) == blob
        await tier.complete_load(lease)  # idempotent on a dead lease
        await tier.complete_load(fresh)
        assert tier.stats().leases == 0 and tier.stats().extra["leases_expired"] == 1
        forgotten = await tier.prepare_load(meta.object_id, owner="gone")  # never completed
        assert await tier.delete(meta.object_id)
        assert tier.stats().bytes_used == meta.size  # still pinned by the forgotten lease
        clock.advance(0.1)
        assert tier.expire_leases() == 1
        stats = tier.stats()
        assert (stats.leases, stats.bytes_used, stats.extra["extent_bytes_allocated"]) == (0, 0, 0)
        with pytest.raises(LeaseError):
            await tier.read(forgotten)


async def test_release_owner_drops_only_that_owners_leases(tier: HostTier) -> None:
    meta, blob = make_object(1000)
    await put(tier, meta, blob)
    gone = [await tier.prepare_load(meta.object_id, owner="conn-1") for _ in range(3)]
    kept = await tier.prepare_load(meta.object_id, owner="conn-2")
    assert await tier.release_owner("conn-1") == 3
    for lease in gone:
        with pytest.raises(LeaseError):
            await tier.read(lease)
    assert bytes(await tier.read(kept)) == blob
    assert tier.stats().leases == 1


async def test_deleting_a_leased_object_hides_it_and_frees_it_after_the_last_lease(tier: HostTier) -> None:
    meta, blob = make_object(20_000)
    await put(tier, meta, blob)
    first = await tier.prepare_load(meta.object_id, owner="a")
    second = await tier.prepare_load(meta.object_id, owner="b")
    assert await tier.delete(meta.object_id)
    assert not await tier.delete(meta.object_id)
    assert not await tier.contains(meta.object_id)
    with pytest.raises(NotFound):
        await tier.prepare_load(meta.object_id)
    assert bytes(await tier.read(first)) == blob  # the bytes stay pinned
    await tier.complete_load(first)
    assert tier.stats().bytes_used == meta.size
    assert bytes(await tier.read(second)) == blob
    await tier.release_owner("b")
    stats = tier.stats()
    assert (stats.bytes_used, stats.extra["extent_bytes_allocated"], stats.extra["deleted_but_leased"]) == (0, 0, 0)


# ---------------------------------------------------------------------------- compaction


async def test_compaction_slides_objects_down_and_merges_free_space() -> None:
    async with HostTier(HostTierOptions(1 * MIB, pin_memory=False)) as tier:
        objects = [make_object(60_000) for _ in range(6)]
        for meta, blob in objects:
            await put(tier, meta, blob)
        for index in (0, 2, 4):
            await tier.delete(objects[index][0].object_id)
        before = tier.stats().extra
        assert before["fragmentation"] > 0
        report = await tier.compact()
        # the highest object drops into the first hole, the next into the second; the
        # lowest survivor has nowhere lower to go, and now nothing is scattered
        assert (report.moved, report.blocked) == (2, 0)
        assert report.bytes_moved == 2 * objects[0][0].size
        assert report.largest_free_after > report.largest_free_before
        after = tier.stats()
        assert after.extra["fragmentation"] == 0.0 and after.compactions_run == 1
        for meta, blob in objects[1::2]:
            lease = await tier.prepare_load(meta.object_id)
            assert lease.location[0] < 3 * 61440
            assert bytes(await tier.read(lease)) == blob
            await tier.complete_load(lease)


async def test_a_lease_taken_during_a_move_keeps_the_old_bytes_and_abandons_the_move() -> None:
    executor = ThreadPoolExecutor(1)
    release = threading.Event()
    try:
        async with HostTier(HostTierOptions(4 * MIB, pin_memory=False, inline_copy_bytes=0), executor=executor) as tier:
            low, low_blob = make_object(500_000)
            high, high_blob = make_object(300_000)
            await put(tier, low, low_blob)
            await put(tier, high, high_blob)
            await tier.delete(low.object_id)
            executor.submit(release.wait)  # hold the move's copy in the queue
            compaction = asyncio.create_task(tier.compact())
            await asyncio.sleep(0)
            lease = await tier.prepare_load(high.object_id)  # while the move is in flight
            release.set()
            report = await compaction
            assert (report.moved, report.blocked) == (0, 1)
            assert bytes(await tier.read(lease)) == high_blob  # location still valid
            await tier.complete_load(lease)
            assert (await tier.compact()).moved == 1  # unleased now: it moves
            assert await read_bytes(tier, high.object_id) == high_blob
            assert tier.stats().compactions_blocked == 1
    finally:
        release.set()
        executor.shutdown()


async def test_compaction_under_concurrent_leased_readers_never_tears_a_read() -> None:
    rng = random.Random(7)
    async with HostTier(HostTierOptions(6 * MIB, pin_memory=False, inline_copy_bytes=0)) as tier:
        sizes = [rng.randrange(20_000, 120_000) for _ in range(40)]
        live, (_, top_blob), long_reader = await fragment(tier, sizes, make_object)  # leased: never moves
        counts = {"reads": 0, "bad": 0}
        stop = asyncio.Event()

        async def reader(seed: int) -> None:
            pick = random.Random(seed)
            while not stop.is_set():
                object_id = pick.choice(list(live))
                expected = live.get(object_id)
                try:
                    lease = await tier.prepare_load(object_id, owner=seed)
                except NotFound:
                    continue  # churned away meanwhile
                try:
                    await asyncio.sleep(0)  # hold the lease across a compaction step
                    view = await tier.read(lease)
                    await asyncio.sleep(0)
                    if bytes(view) != expected:
                        counts["bad"] += 1
                    elif counts["reads"] % 25 == 0:
                        open_sealed(view, None, KEYRING)  # full signature and digest check
                    counts["reads"] += 1
                finally:
                    await tier.complete_load(lease)

        async def compactor() -> None:
            for _ in range(30):
                await tier.compact()
                for object_id in rng.sample(list(live), 2):  # churn: new holes, new objects
                    await tier.delete(object_id)
                    del live[object_id]
                for _ in range(2):
                    meta, blob = make_object(rng.randrange(20_000, 120_000))
                    try:
                        await put(tier, meta, blob)
                    except CapacityError:
                        continue
                    live[meta.object_id] = blob
                await asyncio.sleep(0)
            stop.set()

        await asyncio.gather(compactor(), *(reader(seed) for seed in range(8)))
        assert bytes(await tier.read(long_reader)) == top_blob  # held through 30 compactions
        await tier.complete_load(long_reader)
        stats = tier.stats()
        assert counts["bad"] == 0 and counts["reads"] > 100
        assert stats.compactions_run == 30
        assert stats.compactions_blocked > 0
        assert stats.extra["bytes_moved"] > 0
        assert stats.extra["lease_violations"] == 0 and stats.leases == 0
        for object_id, blob in live.items():
            assert await read_bytes(tier, object_id) == blob
