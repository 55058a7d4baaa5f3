"""Issue 36: a load's promotion takes free room only; a load never evicts.

Stories, over a real host arena above a real disk tier: loads of copies that live on disk
only promote into the arena's free room (read straight into the reservation), and once the
arena is full the rest are served from disk and left to the write-behind worker, which makes
room by the arena's watermarks (evicting and demoting) and promotes them then. The arena's
eviction count does not move while the loads run; it moves once the worker runs.
"""

from __future__ import annotations

import asyncio

from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.requests import LoadRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, prefix_hashes
from statetier.protocol.keyring import Keyring
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.registry import MemoryVersionRegistry

SPECS = (TensorSpec("ssm", "float32", (64, 60)),)  # 15 KiB of payload: one 16 KiB extent with its header
OBJECT_EXTENT = 16 * 1024
CHAIN = prefix_hashes(list(range(64)), 16)
NAMESPACES = {"alice": NamespaceSpec("promotion", tenant="alice").namespace()}


def data(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(SPECS[0].nbytes))


async def put(engine: Engine, tenant: str, layer: int):
    key = StateKey(NAMESPACES[tenant], Kind.SSM, layer, CHAIN[3], 0, 64)
    return await engine.put(PutRequest(tenant, key, Provenance(f"{tenant}-{layer}", 3), SPECS), data(layer))


async def test_a_load_promotes_into_free_room_only_and_leaves_the_rest_to_the_write_behind_worker(tmp_path):
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(4 * OBJECT_EXTENT, pin_memory=False, high_watermark=1.0, low_watermark=0.5))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    engine = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="promotion"), arena=host)
    # the tiers started, the engine's write-behind worker not yet: whatever a load leaves to
    # it waits in its queue, so every eviction counted below is a load's own
    for tier in (host, disk):
        await tier.start()
    worker: asyncio.Task | None = None
    try:
        refs = [(await put(engine, "alice", layer)).ref for layer in range(8)]  # puts evict and demote
        in_arena = [ref for ref in refs if await host.contains(ref.state_id)]
        assert len(in_arena) == host.stats().objects == 2  # room for two more
        evictions = host.stats().evictions

        below = [ref for ref in refs if ref not in in_arena]
        served = []
        for ref in below:
            result = await engine.load(LoadRequest("alice", NAMESPACES["alice"], ref=ref), owner="c")
            assert bytes(result.payload) == data(ref.key.layer)
            served.append(result.tier)
            await engine.release(result.lease_id, "c")
        assert served == ["host", "host", "disk", "disk", "disk", "disk"]  # the free room, then from below
        assert host.stats().evictions == evictions  # no load evicted
        assert engine.placement.write_behind_pending == 4  # the promotions that found no room

        worker = asyncio.create_task(engine.placement.run_write_behind())
        assert await engine.placement.flush_write_behind(10)
        assert host.stats().evictions > evictions  # the worker made room by the watermarks
        assert await host.contains(below[-1].state_id)  # and promoted the last one asked for
        result = await engine.load(LoadRequest("alice", NAMESPACES["alice"], ref=below[-1]), owner="c")
        assert result.tier == "host" and bytes(result.payload) == data(below[-1].key.layer)
        await engine.release(result.lease_id, "c")
    finally:
        if worker is not None:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        await engine.close()


async def test_an_eviction_from_the_lowest_tier_copies_no_victim_out():
    """A daemon whose arena is its only tier: the puts that fill it past its watermark evict,
    and the victims are dropped without their bytes being copied out first (there is nowhere
    to demote them: the copy was a whole watermark band of memcpy per eviction, for nothing).
    Counted on the arena's own byte mover."""
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(4 * OBJECT_EXTENT, pin_memory=False, high_watermark=1.0, low_watermark=0.5))
    engine = Engine([host], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="lowest"), arena=host)
    await host.start()
    movers = host._region.space.bytes  # the arena's byte mover (tiers.memory.hostbytes)
    copied_out: list[int] = []
    real_copy_out = movers.copy_out

    async def counted_copy_out(places):
        copied_out.append(len(places))
        return await real_copy_out(places)

    movers.copy_out = counted_copy_out
    try:
        refs = [(await put(engine, "alice", layer)).ref for layer in range(8)]
        assert host.stats().evictions >= 4 and engine.placement.dropped == host.stats().evictions
        assert sum(copied_out) == 0, copied_out
        newest = refs[-1]  # still in the arena, and whole
        result = await engine.load(LoadRequest("alice", NAMESPACES["alice"], ref=newest), owner="c")
        assert bytes(result.payload) == data(newest.key.layer)
    finally:
        await engine.close()
        await host.close()
