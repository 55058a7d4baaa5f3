"""Issue 12: moves between real tiers against deletes, and tenant bytes that follow the moves.

Stories: a delete racing a demotion-by-eviction, at every interleaving the event loop
offers, never leaves a copy that a load or a lookup could reach once the delete has
returned (host arena above disk, and above Redis); a load that read the only copy before a
delete serves its bytes but does not promote them back once the delete is done. After puts, write-behind copies,
published copies, demotions, promotions and deletes, each tenant's usage in each tier
equals the bytes of its objects there (and a tenant with a host quota can put again once
its bytes were demoted).
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from statetier.daemon.engine import Engine, EngineOptions, Publishing
from statetier.daemon.requests import LoadRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import NotFound
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, prefix_hashes
from statetier.protocol.keyring import Keyring
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.registry import MemoryVersionRegistry
from tests.support.redis_tier import erase_prefix

SPECS = (TensorSpec("ssm", "float32", (64, 60)),)  # 15 KiB of payload: one 16 KiB extent with its header
OBJECT_EXTENT = 16 * 1024
CHAIN = prefix_hashes(list(range(64)), 16)
NAMESPACES = {tenant: NamespaceSpec("moves", tenant=tenant).namespace() for tenant in ("alice", "bob")}


def data(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(SPECS[0].nbytes))


def key(tenant: str, layer: int) -> StateKey:
    return StateKey(NAMESPACES[tenant], Kind.SSM, layer, CHAIN[3], 0, 64)


async def put(engine: Engine, tenant: str, layer: int, *, publish: bool = False):
    req = PutRequest(tenant, key(tenant, layer), Provenance(f"{tenant}-{layer}", 3), SPECS, publish=publish)
    return await engine.put(req, data(layer))


@pytest.fixture(params=["disk", "redis"])
async def lower(request, tmp_path):
    """The tier under the host arena: what a demotion writes into."""
    keyring = Keyring.generate()
    if request.param == "disk":
        yield keyring, DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20),
            keyring=keyring), None
        return
    server = request.getfixturevalue("redis_server")
    prefix = f"moves-{uuid.uuid4().hex[:10]}"
    yield keyring, RedisTier(RedisTierOptions(server.url, key_prefix=prefix), keyring=keyring), prefix
    erase_prefix(server.url, prefix)


async def engine_over(keyring, tiers, *, write_behind: bool = True, **options) -> Engine:
    host = tiers[0]
    engine = Engine(tiers, keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="moves", **options), arena=host,
                    write_behind_to=tiers[1] if write_behind and tiers[1].name == "disk" else None)
    await engine.start()
    return engine


async def reachable(engine: Engine, tenant: str, ref) -> list[str]:
    """Where a copy of ``ref`` can still be found: by id in a tier, or by key."""
    found = [tier.name for tier in engine.tiers if await tier.contains(ref.state_id)]
    found += [f"key:{tier.name}" for meta, tier in await engine.locate(ref.key) if meta.object_id == ref.state_id]
    try:
        served = await engine.load(LoadRequest(tenant, ref.key.namespace, ref=ref), owner="probe")
    except NotFound:
        return found
    await engine.release(served.lease_id, "probe")
    return [*found, "load"]


async def test_a_delete_racing_a_demotion_never_leaves_a_reachable_copy(lower):
    keyring, tier, _ = lower
    host = HostTier(HostTierOptions(2 * OBJECT_EXTENT, pin_memory=False, high_watermark=1.0, low_watermark=0.5))
    engine = await engine_over(keyring, [host, tier], write_behind=False)  # the only copy is the demoted one
    try:
        outcomes = set()
        for round_ in range(48):
            victim = (await put(engine, "alice", 1000 + round_)).ref
            await put(engine, "alice", 2000 + round_)  # the arena is full: the next put evicts the victim

            evicting = asyncio.create_task(put(engine, "alice", 3000 + round_))

            async def delete_after(yields: int):
                for _ in range(yields):
                    await asyncio.sleep(0)
                if round_ % 2:  # the narrowest window: the eviction has just taken it from the arena
                    while not evicting.done() and await host.contains(victim.state_id):
                        await asyncio.sleep(0)
                return await engine.delete("alice", victim)

            _, deleted = await asyncio.gather(evicting, delete_after(round_ // 2 % 16))
            outcomes.add(deleted)
            assert await reachable(engine, "alice", victim) == [], f"round {round_}"
            for meta in [m async for m in host.iter_objects()]:  # next round starts from an empty arena
                await host.delete(meta.object_id)
        assert outcomes >= {1}  # the delete found the copy (in the arena, or where it was demoted to)
    finally:
        await engine.close()


async def bytes_by_tenant(engine: Engine, owners: dict[bytes, str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for tier in engine.tiers:
        async for meta in tier.iter_objects():
            tenant = owners[meta.object_id]
            out.setdefault(tenant, {})
            out[tenant][tier.name] = out[tenant].get(tier.name, 0) + meta.size
    return out


def nonzero(usage: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {t: {tier: n for tier, n in tiers.items() if n} for t, tiers in usage.items()
            if any(tiers.values())}


async def test_each_tenants_usage_per_tier_is_the_bytes_of_its_objects_there(tmp_path, redis_server):
    keyring = Keyring.generate()
    prefix = f"moves-{uuid.uuid4().hex[:10]}"
    host = HostTier(HostTierOptions(4 * OBJECT_EXTENT, pin_memory=False, high_watermark=1.0, low_watermark=0.5))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    cross = RedisTier(RedisTierOptions(redis_server.url, key_prefix=prefix), keyring=keyring)
    engine = Engine([host, disk, cross], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="moves"), arena=host, publishing=Publishing(cross, cross, marks=cross), write_behind_to=disk)
    await engine.start()
    owners: dict[bytes, str] = {}
    try:
        refs = {"alice": [], "bob": []}
        for layer in range(6):  # puts; every put after the fourth evicts and demotes
            for tenant in ("alice", "bob"):
                ref = (await put(engine, tenant, layer, publish=layer % 3 == 0)).ref  # some published
                refs[tenant].append(ref)
                owners[ref.state_id] = tenant
        assert await engine.placement.flush_write_behind(10)  # write-behind copies into disk
        # loads from below promote back into the arena; alice's second load comes last, so
        # no later promotion evicts it (an eviction goes down to the low watermark)
        for index in range(2):
            for tenant in ("bob", "alice"):
                ref = refs[tenant][index]
                served = await engine.load(LoadRequest(tenant, NAMESPACES[tenant], ref=ref), owner="c")
                await engine.release(served.lease_id, "c")
        await engine.delete("alice", refs["alice"][0])  # deletes free every copy
        await engine.delete("bob", refs["bob"][3])
        assert await engine.placement.flush_write_behind(10)

        assert nonzero(engine.tenancy.usage()) == await bytes_by_tenant(engine, owners)
        used = await bytes_by_tenant(engine, owners)
        assert set(used["alice"]) == {"host", "disk", "redis"}  # every kind of copy happened
    finally:
        await engine.close()
        erase_prefix(redis_server.url, prefix)


async def test_a_tenant_with_a_host_quota_can_put_again_once_its_bytes_were_demoted(tmp_path):
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(4 * OBJECT_EXTENT, pin_memory=False, high_watermark=1.0, low_watermark=0.5))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    quota = {"alice": {"host": 2 * OBJECT_EXTENT}}
    engine = await engine_over(keyring, [host, disk], quotas=quota)
    try:
        first = [(await put(engine, "alice", layer)).ref for layer in range(2)]
        assert (await put(engine, "alice", 2)).tier == "disk"  # her host quota is full
        for layer in range(4):  # bob fills the arena: alice's objects are demoted to disk
            assert (await put(engine, "bob", layer)).tier == "host"
        still_in_arena = [ref for ref in first if await host.contains(ref.state_id)]
        assert len(still_in_arena) < 2
        in_arena = sum([(await host.get_meta(ref.state_id)).size for ref in still_in_arena])
        assert engine.tenancy.usage()["alice"].get("host", 0) == in_arena
        assert (await put(engine, "alice", 3)).tier == "host"  # her bytes left the arena: room again
    finally:
        await engine.close()


async def test_write_behind_copies_count_against_the_tenants_disk_quota(tmp_path):
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(8 * OBJECT_EXTENT, pin_memory=False))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    engine = await engine_over(keyring, [host, disk], quotas={"alice": {"disk": 2 * OBJECT_EXTENT}})
    try:
        refs = [(await put(engine, "alice", layer)).ref for layer in range(4)]
        assert await engine.placement.flush_write_behind(10)
        on_disk = [ref for ref in refs if await disk.contains(ref.state_id)]
        assert len(on_disk) == 2  # the quota's worth: the other write-behind copies were not made
        assert engine.tenancy.usage()["alice"]["disk"] == sum([meta.size async for meta in disk.iter_objects()])
        assert engine.placement.write_behind_skipped == 2
    finally:
        await engine.close()


async def test_a_load_that_read_a_lower_copy_before_a_delete_never_promotes_it_back(redis_server):
    # the load leases and reads the only copy (in Redis); a delete runs to its end meanwhile
    # (the lease keeps the bytes readable); the load then serves its bytes, but promoting them
    # into the arena would bring the deleted object back (seen as a purge that left an object).
    # The read outside a promotion, as when the arena has no free room to read into (the
    # promotion is left to the write-behind worker; a read into the arena runs inside the
    # promotion's cycle, which the delete waits for: next test)
    keyring, prefix = Keyring.generate(), f"moves-{uuid.uuid4().hex[:10]}"
    cross = RedisTier(RedisTierOptions(redis_server.url, key_prefix=prefix), keyring=keyring)
    host = HostTier(HostTierOptions(8 * OBJECT_EXTENT, pin_memory=False, high_watermark=1.0, low_watermark=0.5))
    engine = Engine([host, cross], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="moves"), arena=host, publishing=Publishing(cross, cross, marks=cross))
    await engine.start()
    try:
        ref = (await put(engine, "alice", 1, publish=True)).ref
        await host.delete(ref.state_id)  # the Redis copy is the only one, as on another node
        for layer in range(8):  # bob fills the arena: no free room for a promotion
            assert (await put(engine, "bob", layer)).tier == "host"
        read, reading, opened = cross.read, asyncio.Event(), asyncio.Event()

        async def read_at_the_gate(lease, *, into=None, verify=True):
            blob = await read(lease, into=into, verify=verify)
            if lease.owner == "c":  # the load's read (not the write-behind worker's promotion)
                reading.set()
                await opened.wait()
            return blob

        cross.read = read_at_the_gate
        loading = asyncio.create_task(engine.load(LoadRequest("alice", NAMESPACES["alice"], ref=ref), owner="c"))
        await reading.wait()
        # the Redis copy; and the arena's, when the write-behind worker's promotion landed first
        assert await engine.delete("alice", ref) in (1, 2)
        opened.set()
        served = await loading
        assert bytes(served.payload) == data(1)  # a load in flight finishes with the bytes it was given
        assert served.tier == "redis"
        await engine.release(served.lease_id, "c")
        assert await engine.placement.flush_write_behind(10)  # the promotion left to the worker
        assert await reachable(engine, "alice", ref) == []
    finally:
        await engine.close()
        erase_prefix(redis_server.url, prefix)


async def test_a_delete_during_a_read_into_the_arena_waits_for_it_and_removes_the_promoted_copy(redis_server):
    # the promotion reads the only copy (in Redis) straight into its arena reservation, inside
    # its placement cycle: a delete begun meanwhile settles that cycle before its last sweep,
    # so the promoted copy goes with the rest; the load serves the bytes it was given
    keyring, prefix = Keyring.generate(), f"moves-{uuid.uuid4().hex[:10]}"
    cross = RedisTier(RedisTierOptions(redis_server.url, key_prefix=prefix), keyring=keyring)
    host = HostTier(HostTierOptions(8 * OBJECT_EXTENT, pin_memory=False))
    engine = Engine([host, cross], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="moves"), arena=host, publishing=Publishing(cross, cross, marks=cross))
    await engine.start()
    try:
        ref = (await put(engine, "alice", 1, publish=True)).ref
        await host.delete(ref.state_id)  # the Redis copy is the only one, as on another node
        read, reading, opened = cross.read, asyncio.Event(), asyncio.Event()

        async def read_at_the_gate(lease, *, into=None, verify=True):
            blob = await read(lease, into=into, verify=verify)
            if into is not None:  # the promotion's read into its arena reservation
                reading.set()
                await opened.wait()
            return blob

        cross.read = read_at_the_gate
        loading = asyncio.create_task(engine.load(LoadRequest("alice", NAMESPACES["alice"], ref=ref), owner="c"))
        await reading.wait()
        deleting = asyncio.create_task(engine.delete("alice", ref))
        await asyncio.sleep(0.05)
        assert not deleting.done()  # it waits for the promotion's cycle
        opened.set()
        served = await loading
        assert bytes(served.payload) == data(1) and served.tier == "host"
        await engine.release(served.lease_id, "c")
        assert await deleting >= 1
        assert await reachable(engine, "alice", ref) == []
    finally:
        await engine.close()
        erase_prefix(redis_server.url, prefix)
