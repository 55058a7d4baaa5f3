"""DeviceTier on a real torch pool (``cpu`` here; CUDA is exercised by scripts/gpu_check.py)."""

from __future__ import annotations

import asyncio
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

from statetier.protocol.dtypes import TensorSpec  # noqa: E402
from statetier.protocol.errors import CapacityError, ConfigError, InvalidRequest, LeaseError  # noqa: E402
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, new_state_id  # noqa: E402
from statetier.protocol.keyring import dev_keyring  # noqa: E402
from statetier.protocol.sealed import decode_header, open_sealed, seal_object  # noqa: E402
from statetier.tiers.base import ObjectMeta  # noqa: E402
from statetier.tiers.memory import DeviceTier, DeviceTierOptions  # noqa: E402
from tests.support.tier_contract import (  # noqa: E402
    assert_cancelled_store_leaves_nothing,
    assert_invisible,
    assert_read_view_released,
    assert_visible,
    fragment,
    load,
    store,
)

KEYRING = dev_keyring()
NAMESPACE = NamespaceSpec("test/device-tier").namespace()
KIB, MIB = 1024, 1024 * 1024


def sealed(payload_bytes: int, dtype: str = "uint8") -> tuple[ObjectMeta, bytes]:
    itemsize = 4 if dtype == "float32" else 1
    key = StateKey(NAMESPACE, Kind.SSM, 3, os.urandom(32), 0, 64)
    spec = TensorSpec("state", dtype, (payload_bytes // itemsize,))
    blob = seal_object(key, Provenance("req-9"), [(spec, os.urandom(spec.nbytes))], keyring=KEYRING,
                       state_id=new_state_id(), version=1)
    return ObjectMeta.from_header(decode_header(blob)), blob


put, read_bytes = store, load  # the shared store/load steps of the contract suite


@pytest.fixture
async def tier():
    async with DeviceTier(DeviceTierOptions(4 * MIB, device="cpu")) as pool:
        yield pool


async def test_an_object_is_visible_only_after_complete_store(tier: DeviceTier) -> None:
    meta, blob = sealed(100_000)
    ticket = await tier.prepare_store(meta)
    assert ticket.view is None  # the pool is not written in place by clients
    await tier.write(ticket, [blob])
    await assert_invisible(tier, meta)
    await tier.complete_store(ticket, True)
    await assert_visible(tier, meta)
    await assert_read_view_released(tier, meta, blob, KEYRING)
    assert tier.stats().bytes_used == meta.size


async def test_complete_store_without_the_bytes_is_refused(tier: DeviceTier) -> None:
    meta, blob = sealed(1000)
    ticket = await tier.prepare_store(meta)
    with pytest.raises(InvalidRequest):
        await tier.complete_store(ticket, True)
    assert not await tier.contains(meta.object_id)
    assert tier.stats().extra["extent_bytes_allocated"] == 0


async def test_write_from_tensor_and_read_into() -> None:
    async with DeviceTier(DeviceTierOptions(8 * MIB, device="cpu", inline_copy_bytes=16 * KIB)) as tier:
        meta, blob = sealed(2 * MIB, dtype="float32")
        payload = torch.frombuffer(bytearray(blob[meta.header_len :]), dtype=torch.float32)
        ticket = await tier.prepare_store(meta)
        try:
            await tier.write(ticket, [blob[: meta.header_len]])
            await tier.write_from_tensor(ticket, payload.reshape(512, -1))
            await tier.complete_store(ticket, True)
        except BaseException:
            await tier.complete_store(ticket, False)
            raise
        lease = await tier.prepare_load(meta.object_id)
        dest = bytearray(meta.size)
        assert bytes(await tier.read(lease, into=memoryview(dest))) == blob
        assert dest == blob
        opened = open_sealed(await tier.read(lease), None, KEYRING)
        assert opened.header.tensors[0].spec.dtype == "float32"
        await tier.complete_load(lease)
        with pytest.raises(LeaseError):
            await tier.read(lease, into=memoryview(dest))


async def test_capacity_error_and_duplicate_ids() -> None:
    async with DeviceTier(DeviceTierOptions(256 * KIB)) as tier:
        first, first_blob = sealed(150 * KIB)
        await put(tier, first, first_blob)
        with pytest.raises(InvalidRequest):
            await tier.prepare_store(first)
        second, _ = sealed(150 * KIB)
        with pytest.raises(CapacityError):
            await tier.prepare_store(second)


@pytest.mark.parametrize("where", ["before_write", "write_queued", "during_write", "after_write"])
async def test_a_cancelled_store_leaves_nothing_and_returns_its_space(where: str) -> None:
    def open_tier(executor) -> DeviceTier:
        return DeviceTier(DeviceTierOptions(16 * MIB, inline_copy_bytes=0), executor=executor)

    await assert_cancelled_store_leaves_nothing(open_tier, sealed, 12 * MIB, where)


async def test_evict_returns_least_recently_used_unleased_objects_with_their_bytes() -> None:
    objects = {name: sealed(7_600) for name in "ABCDEFGH"}
    async with DeviceTier(DeviceTierOptions(10 * 8192, high_watermark=0.9, low_watermark=0.55)) as tier:
        for meta, blob in objects.values():
            await put(tier, meta, blob)
        assert await tier.evict(0) == []
        for name in "BD":
            await read_bytes(tier, objects[name][0].object_id)
        held = await tier.prepare_load(objects["C"][0].object_id)
        evicted = await tier.evict(need_bytes=12_000)
        names = {meta.object_id: name for name, (meta, _) in objects.items()}
        assert [names[e.meta.object_id] for e in evicted] == ["A", "E", "F", "G"]
        assert all(bytes(e.blob) == objects[names[e.meta.object_id]][1] for e in evicted)
        assert [names[m.object_id] async for m in tier.iter_objects()] == ["H", "B", "D", "C"]
        await tier.complete_load(held)


async def test_leases_expire_belong_to_owners_and_defer_deletes(clock) -> None:
    async with DeviceTier(DeviceTierOptions(1 * MIB, lease_ttl=0.05, clock=clock)) as tier:
        meta, blob = sealed(30_000)
        await put(tier, meta, blob)
        short = await tier.prepare_load(meta.object_id, owner="a")
        mine = await tier.prepare_load(meta.object_id, owner="b", ttl=60)
        other = await tier.prepare_load(meta.object_id, owner="c", ttl=60)
        clock.advance(0.1)
        with pytest.raises(LeaseError):
            await tier.read(short)
        assert await tier.delete(meta.object_id)
        assert not await tier.contains(meta.object_id)
        assert bytes(await tier.read(mine)) == blob
        assert await tier.release_owner("b") == 1
        with pytest.raises(LeaseError):
            await tier.read(mine)
        assert tier.stats().bytes_used == meta.size  # still leased by c
        assert bytes(await tier.read(other)) == blob
        await tier.complete_load(other)
        stats = tier.stats()
        assert (stats.bytes_used, stats.leases, stats.extra["extent_bytes_allocated"]) == (0, 0, 0)


async def test_compaction_of_the_pool_under_leased_readers() -> None:
    rng = random.Random(3)
    async with DeviceTier(DeviceTierOptions(4 * MIB, inline_copy_bytes=0)) as tier:
        sizes = [rng.randrange(10_000, 90_000) for _ in range(24)]
        live, (top, top_blob), long_reader = await fragment(tier, sizes, sealed)  # leased: never moves
        bad, stop = [], asyncio.Event()

        async def reader(seed: int) -> None:
            pick = random.Random(seed)
            while not stop.is_set():
                object_id = pick.choice(list(live))
                lease = await tier.prepare_load(object_id, owner=seed)
                try:
                    await asyncio.sleep(0)
                    if bytes(await tier.read(lease)) != live[object_id]:
                        bad.append(object_id)
                finally:
                    await tier.complete_load(lease)

        async def compactor() -> None:
            for _ in range(10):
                await tier.compact()
                await asyncio.sleep(0)
            stop.set()

        await asyncio.gather(compactor(), *(reader(seed) for seed in range(4)))
        assert long_reader.location == (await tier.prepare_load(top.object_id)).location  # never moved
        assert bytes(await tier.read(long_reader)) == top_blob
        await tier.release_owner("slow client")
        await tier.release_owner(None)
        stats = tier.stats()
        assert bad == [] and stats.compactions_run == 10
        assert stats.compactions_blocked > 0 and stats.extra["bytes_moved"] > 0
        assert (await tier.compact()).blocked == 0  # no leases left: nothing is in the way
        for object_id, blob in live.items():
            assert await read_bytes(tier, object_id) == blob


@pytest.mark.parametrize("device", ["meta", "no-such-device"] + ([] if torch.cuda.is_available() else ["cuda"]))
async def test_an_unusable_device_is_a_config_error(device: str) -> None:
    tier = DeviceTier(DeviceTierOptions(1 * MIB, device=device))
    with pytest.raises(ConfigError):
        await tier.start()
    with pytest.raises(RuntimeError):
        await tier.prepare_load(b"x" * 16)


async def test_single_thread_copies_is_applied_in_the_copy_threads_only_when_asked() -> None:
    def threads_after_a_copy(flag: bool) -> int:
        async def run() -> int:
            executor = ThreadPoolExecutor(1)
            try:
                async with DeviceTier(DeviceTierOptions(1 * MIB, single_thread_copies=flag), executor=executor) as tier:
                    meta, blob = sealed(4000)
                    ticket = await tier.prepare_store(meta)
                    await tier.write_from_tensor(ticket, torch.frombuffer(bytearray(blob), dtype=torch.uint8))
                    await tier.complete_store(ticket, True)
                    return await asyncio.wrap_future(executor.submit(torch.get_num_threads))
            finally:
                executor.shutdown()

        return asyncio.run(run())

    main_thread = torch.get_num_threads()
    # fresh event loops in a helper thread: the test's own loop is untouched
    with ThreadPoolExecutor(1) as outer:
        assert outer.submit(threads_after_a_copy, False).result() == main_thread
        assert outer.submit(threads_after_a_copy, True).result() == 1
        outer.submit(torch.set_num_threads, main_thread).result()  # what later threads inherit
    assert torch.get_num_threads() == main_thread
