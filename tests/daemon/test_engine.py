"""The engine over real tiers: a shared-memory host arena above an LMDB/segment disk tier.

Stories: a put is served back verified; a damaged copy is dropped and the next copy is
served (never the damaged bytes); eviction demotes instead of dropping; versions fence
stale puts and loads; tenants cannot read each other's namespaces; the zero-copy put;
the joint hit.
"""

from __future__ import annotations

import asyncio
import gc
import shutil

import pytest

from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.metrics import Metrics
from statetier.daemon.requests import LoadRequest, LookupRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import (
    CorruptPayload,
    Forbidden,
    MisroutedState,
    NamespaceMismatch,
    NotFound,
    PositionMismatch,
    QuotaExceeded,
    StaleState,
    UnsupportedFormat,
)
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import parse_header, verify_payload_only
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.registry import MemoryVersionRegistry
from tests.support.engine_objects import CHAIN, NS, SPECS, payload_for, ssm_put
from tests.support.host_tier import offset_in_arena

OTHER_NS = NamespaceSpec("bamba-tiny").namespace()


def kv_put(layer: int, block: int, request: str = "req-1") -> tuple[PutRequest, bytes]:
    key = StateKey(NS, Kind.KV, layer, CHAIN[block], 16 * block, 16 * (block + 1))
    return PutRequest("default", key, Provenance(request, step=block), SPECS), payload_for(100 + block)


@pytest.fixture
async def engine(tmp_path):
    keyring = Keyring.generate()
    object_bytes = 20 * 1024  # header + payload of one SPECS object, in 4 KiB extents
    host = HostTier(HostTierOptions(6 * object_bytes, granularity=4096))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    metrics = Metrics()
    engine = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(), metrics=metrics,
                    options=EngineOptions(producer_id="test"), arena=host, write_behind_to=disk)
    await engine.start()
    engine.test_metrics = metrics
    yield engine
    await engine.close()


def rejections(metrics: Metrics, reason: str) -> float:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == "statetier_rejections_total" and sample.labels.get("reason") == reason:
                return sample.value
    return 0.0


async def test_a_put_is_loaded_back_verified_from_the_host_arena(engine):
    req, data = ssm_put()
    put = await engine.put(req, data)
    assert put.tier == "host"
    result = await engine.load(LoadRequest("default", NS, ref=put.ref), owner="c1")
    assert bytes(result.payload) == data
    assert result.tier == "host"
    assert result.header.provenance.producer_id == "test"
    await engine.release(result.lease_id, "c1")
    assert engine.lease_count == 0


async def _damage_host_copy(engine, state_id: bytes, at) -> None:
    host = engine.arena
    offset = await offset_in_arena(host, state_id)
    arena = host.arena_view
    arena[offset + at(await host.get_meta(state_id))] ^= 0x01  # one flipped payload bit in the daemon's own arena
    arena.release()


async def test_a_host_copy_is_not_hashed_again_on_load_the_client_verifies_where_it_lands(engine):
    # the arena is memory only the daemon writes, digested when sealed there: a load from it
    # costs no daemon-side digest pass; the bytes are checked where they land (DESIGN §6),
    # so even damage the daemon did not see never reaches a caller as a tensor
    req, data = ssm_put()
    put = await engine.put(req, data)
    await _damage_host_copy(engine, put.ref.state_id, lambda meta: meta.size - 1)
    result = await engine.load(LoadRequest("default", NS, ref=put.ref), owner="c1")
    assert result.tier == "host" and bytes(result.payload) != data
    with pytest.raises(CorruptPayload):
        verify_payload_only(parse_header(bytes(result.blob[: result.header.header_len])), result.payload)
    await engine.release(result.lease_id, "c1")


async def _take_disk_copy(engine, state_id: bytes):
    """The object's only copy, taken off the disk tier (the host copy dropped): its bytes, to
    damage and store back in its place, and its meta."""
    assert await engine.placement.flush_write_behind(10)
    await engine.arena.delete(state_id)
    disk = engine.tiers[1]
    lease = await disk.prepare_load(state_id)
    blob = bytearray(await disk.read(lease))
    await disk.complete_load(lease)
    await disk.delete(state_id)
    return disk, blob, lease.meta


async def _load_as_the_sdk_does(engine, ref, owner: str = "c1"):
    """A load whose payload is verified where it lands, as the SDK does (``clients.copies``):
    bytes that do not match are asked for again with a full check (the SDK's ``recheck``),
    which drops the damaged copy and serves the next, or raises what the copies had."""
    result = await engine.load(LoadRequest("default", NS, ref=ref), owner=owner)
    try:
        verify_payload_only(parse_header(bytes(result.blob[: result.header.header_len])), result.payload)
        return result
    except CorruptPayload:
        await engine.release(result.lease_id, owner)
    return await engine.load(LoadRequest("default", NS, ref=ref, full_check=True), owner=owner)


async def test_a_damaged_disk_copy_is_dropped_and_the_load_is_refused_with_the_reason(engine):
    req, data = ssm_put()
    put = await engine.put(req, data)
    disk, blob, meta = await _take_disk_copy(engine, put.ref.state_id)
    blob[meta.header_len + 5] ^= 0x80
    await engine.placement.store_in(disk, [bytes(blob)], meta)
    # the daemon does not digest the disk copy (its client verifies where it lands): the
    # client finds the damage and asks again, and that full check drops it, counted once
    with pytest.raises(CorruptPayload):
        await _load_as_the_sdk_does(engine, put.ref)
    assert rejections(engine.test_metrics, "corrupt_payload") == 1
    with pytest.raises(NotFound):  # the damaged copy is gone for good
        await engine.load(LoadRequest("default", NS, ref=put.ref), owner="c1")


async def test_eviction_demotes_to_disk_instead_of_dropping(engine):
    refs = []
    for layer in range(12):  # twice what the host arena holds
        req, data = ssm_put(layer=layer, seed=layer)
        refs.append(((await engine.put(req, data)).ref, data))
    assert engine.placement.dropped == 0
    host_ids = {meta.object_id async for meta in engine.arena.iter_objects()}
    assert refs[0][0].state_id not in host_ids  # the oldest left the arena
    for ref, data in refs:
        result = await engine.load(LoadRequest("default", NS, ref=ref), owner="c1")
        assert bytes(result.payload) == data
        await engine.release(result.lease_id, "c1")


async def test_versions_fence_stale_puts_and_loads(engine):
    first = await engine.put(*ssm_put(seed=1))
    second = await engine.put(*ssm_put(seed=2))
    assert (first.ref.version, second.ref.version) == (1, 2)
    with pytest.raises(StaleState):
        await engine.load(LoadRequest("default", NS, ref=first.ref), owner="c1")
    with pytest.raises(StaleState):  # a late second path replaying version 1
        await engine.put(*ssm_put(seed=3, version=1))
    assert rejections(engine.test_metrics, "stale") == 2  # the refused load and the refused put
    result = await engine.load(LoadRequest("default", NS, ref=second.ref), owner="c1")
    assert bytes(result.payload) == payload_for(2)
    await engine.release(result.lease_id, "c1")


async def test_a_consumer_with_another_namespace_or_position_is_refused(engine):
    put = await engine.put(*ssm_put())
    with pytest.raises(NamespaceMismatch):
        await engine.load(LoadRequest("default", OTHER_NS, ref=put.ref), owner="c1")
    one_off = StateKey(NS, Kind.SSM, 0, CHAIN[3], 0, 63)
    with pytest.raises(NotFound):
        await engine.load(LoadRequest("default", NS, key=one_off), owner="c1")
    shifted = put.ref.__class__(one_off, put.ref.request_id, put.ref.step, put.ref.state_id, put.ref.version)
    with pytest.raises(PositionMismatch):
        await engine.load(LoadRequest("default", NS, ref=shifted), owner="c1")
    assert engine.lease_count == 0


async def test_a_tenant_naming_another_tenants_namespace_reaches_only_its_own(engine):
    put = await engine.put(*ssm_put(tenant="alice"))
    assert put.ref.key.namespace != NS  # stored under alice's own namespace, not the one she named
    req, _ = ssm_put(tenant="bob")  # the very same spec, key and request: bob's namespace is another
    with pytest.raises(NotFound):
        await engine.load(LoadRequest("bob", NS, key=req.key), owner="c1")
    with pytest.raises(NamespaceMismatch):  # alice's ref, handed to bob: her object is not his
        await engine.load(LoadRequest("bob", NS, ref=put.ref), owner="c1")
    with pytest.raises(Forbidden):
        await engine.delete("bob", put.ref)
    mine = await engine.load(LoadRequest("alice", NS, ref=put.ref), owner="c1")
    assert bytes(mine.payload) == ssm_put()[1]
    await engine.release(mine.lease_id, "c1")


async def test_a_shared_put_is_copied_into_the_arena_and_sealed_there(engine):
    req, data = ssm_put(layer=7)
    source = bytearray(data)  # memory its client can still write
    put = await engine.put_shared(req, source)
    source[:] = bytes(len(source))  # changed after the put: nothing stored changes
    result = await engine.load(LoadRequest("default", NS, ref=put.ref), owner="c1")
    assert put.tier == "host" and bytes(result.payload) == data
    await engine.release(result.lease_id, "c1")
    assert engine.arena.stats().objects == 1


async def test_a_connection_that_goes_away_releases_its_leases(engine):
    put = await engine.put(*ssm_put())
    await engine.load(LoadRequest("default", NS, ref=put.ref), owner="gone")
    assert engine.lease_count == 1
    assert await engine.release_owner("gone") == 1
    assert engine.lease_count == 0
    assert await engine.placement.flush_write_behind(10)  # its copy to disk holds a lease meanwhile
    assert engine.arena.stats().leases == 0


async def test_the_joint_hit_needs_every_layer_at_the_same_boundary(engine):
    for layer in (0, 1):
        for block in range(4):
            await engine.put(*kv_put(layer, block))
    await engine.put(*ssm_put(layer=2, boundary=3))
    await engine.put(*ssm_put(layer=3, boundary=1))
    await engine.put(*ssm_put(layer=3, boundary=3))
    await engine.put(*ssm_put(layer=2, boundary=1))
    bounds = tuple((16 * (i + 1), CHAIN[i]) for i in range(4))

    hit = await engine.lookup(LookupRequest("default", NS, (0, 1), (2, 3), bounds), owner="c1")
    assert hit.tokens == 64 and len(hit.objects) == 2 + 2 * 4
    assert engine.lease_count == len(hit.objects)
    await engine.release_owner("c1")

    await engine.delete("default", hit.objects[0][0])  # layer 2's snapshot at 64 tokens
    hit = await engine.lookup(LookupRequest("default", NS, (0, 1), (2, 3), bounds), owner="c1")
    assert hit.tokens == 32  # the next boundary where every layer has state
    no_ssm = await engine.lookup(LookupRequest("default", NS, (0, 1), (2, 3, 4), bounds), owner="c1")
    assert no_ssm.tokens == 0 and no_ssm.objects == []  # never a KV-only hit for a hybrid model
    kv_only_model = await engine.lookup(LookupRequest("default", NS, (0, 1), (), bounds, lease=False), owner="c1")
    assert kv_only_model.tokens == 64


async def test_verify_all_drops_what_no_longer_verifies(engine):
    put = await engine.put(*ssm_put())
    await engine.placement.flush_write_behind(10)
    host = engine.arena
    offset = await offset_in_arena(host, put.ref.state_id)
    arena = host.arena_view
    arena[offset + 100] ^= 0x01  # inside the signed header
    arena.release()
    report = await engine.verify_all()
    assert report["checked"] == 2 and report["dropped"] == 1
    assert report["by_reason"] == {"bad_signature": 1}
    result = await engine.load(LoadRequest("default", NS, ref=put.ref), owner="c1")  # the disk copy
    assert bytes(result.payload) == payload_for(1) and result.tier == "host"  # promoted again
    await engine.release(result.lease_id, "c1")


async def test_a_load_from_disk_lands_in_the_arena_and_a_damaged_record_is_dropped_not_served(engine, tmp_path):
    good, bad = [await engine.put(*ssm_put(layer=layer, seed=layer + 1)) for layer in (0, 1)]
    assert await engine.placement.flush_write_behind(10)
    host = engine.arena
    for put in (good, bad):
        await host.delete(put.ref.state_id)  # only the disk copies are left
    (segment,) = sorted((tmp_path / "disk" / "segments").glob("seg-*.dat"))
    data = bytearray(segment.read_bytes())
    at = data.rindex(payload_for(2)[:64])  # inside the second object's payload
    with open(segment, "r+b") as handle:
        handle.seek(at + 10)
        handle.write(bytes([data[at + 10] ^ 0x01]))

    result = await _load_as_the_sdk_does(engine, good.ref)
    assert bytes(result.payload) == payload_for(1) and result.tier == "host"  # read into its reservation
    await engine.release(result.lease_id, "c1")
    with pytest.raises(CorruptPayload):  # found where it landed; the recheck drops both copies
        await _load_as_the_sdk_does(engine, bad.ref)
    assert not await engine.tiers[1].contains(bad.ref.state_id)
    assert not await host.contains(bad.ref.state_id)
    assert (host.stats().objects, host.stats().inflight, host.stats().leases) == (1, 0, 0)


class StreamReadCountingRegistry(MemoryVersionRegistry):
    """A real in-memory registry that counts the state_id → stream records it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.stream_reads = 0

    async def stream_of(self, state_id: bytes) -> bytes | None:
        self.stream_reads += 1
        return await super().stream_of(state_id)

    async def read_many(self, stream_ids, state_ids):
        self.stream_reads += len(state_ids)
        return await super().read_many(stream_ids, state_ids)


async def test_a_load_by_ref_remembers_the_stream_its_state_was_issued_for(tmp_path):
    keyring, registry = Keyring.generate(), StreamReadCountingRegistry()
    host = HostTier(HostTierOptions(1 << 20, granularity=4096))
    ours = Engine([host], keyring=keyring, registry=registry, arena=host)
    other = Engine([HostTier(HostTierOptions(1 << 20, granularity=4096))], keyring=keyring, registry=registry)
    await ours.start()
    await other.start()
    try:
        put = await ours.put(*ssm_put())
        for _ in range(2):
            result = await ours.load(LoadRequest("default", NS, ref=put.ref), owner="c1")
            await ours.release(result.lease_id, "c1")
        assert registry.stream_reads == 0  # issued by this engine: known since its claim
        with pytest.raises(NotFound):  # another daemon asks the registry once, then remembers
            await other.load(LoadRequest("default", NS, ref=put.ref), owner="c1")
        with pytest.raises(NotFound):
            await other.load(LoadRequest("default", NS, ref=put.ref), owner="c1")
        assert registry.stream_reads == 1
    finally:
        await ours.close()
        await other.close()


async def test_a_delete_during_the_write_behind_copy_leaves_no_copy_on_disk(engine):
    put = await engine.put(*ssm_put())
    for _ in range(100_000):  # bounded: until the write-behind copy holds its lease on the host
        if engine.arena.stats().leases:
            break
        await asyncio.sleep(0)
    assert engine.arena.stats().leases == 1  # the copy is inside the disk store now
    assert await engine.delete("default", put.ref) == 1
    await engine.placement.flush_write_behind(10)
    disk = engine.tiers[1]
    assert not await disk.contains(put.ref.state_id)
    assert [tier.objects for tier in engine.tier_stats()] == [0, 0]
    with pytest.raises(NotFound):
        await engine.load(LoadRequest("default", NS, ref=put.ref), owner="c1")


async def test_a_delete_is_acknowledged_only_once_no_copy_of_the_object_is_on_its_way(engine, tmp_path):
    put = await engine.put(*ssm_put())
    for _ in range(100_000):  # bounded: until the write-behind copy holds its lease on the host
        if engine.arena.stats().leases:
            break
        await asyncio.sleep(0)
    assert engine.arena.stats().leases == 1

    assert await engine.delete("default", put.ref) >= 1

    # what a kill -9 right now would leave on disk: the copy must not be there, nor still coming
    assert engine.arena.stats().leases == 0
    disk = engine.tiers[1]
    assert not await disk.contains(put.ref.state_id)
    snapshot = tmp_path / "after-delete"
    shutil.copytree(tmp_path / "disk", snapshot)
    reopened = DiskTier(DiskTierOptions(snapshot, 64 << 20, segment_bytes=1 << 20), keyring=engine.keyring)
    await reopened.start()
    try:
        assert not await reopened.contains(put.ref.state_id)
    finally:
        await reopened.close()


async def test_a_load_while_its_object_is_demoted_waits_for_the_demotion_instead_of_missing(tmp_path):
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(6 * 20 * 1024, granularity=4096))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    engine = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="test"))  # no write-behind: demotion is the only copy
    await engine.start()
    try:
        puts = [await engine.put(*kv_put(layer, 0)) for layer in range(6)]  # the host is full
        evicting = asyncio.create_task(engine.put(*kv_put(7, 0)))  # demotes the LRU to make room
        victim = None
        for _ in range(100_000):  # bounded: until one object is in neither tier, on its way down
            for put in puts:
                if not await host.contains(put.ref.state_id) and not await disk.contains(put.ref.state_id):
                    victim = put
            if victim is not None or evicting.done():
                break
            await asyncio.sleep(0)
        assert victim is not None, "the demotion was never caught in flight"
        result = await engine.load(LoadRequest("default", NS, ref=victim.ref), owner="c1")
        assert bytes(result.payload) == payload_for(100)
        await engine.release(result.lease_id, "c1")
        await evicting
    finally:
        await engine.close()


def anonymous_shared_mappings() -> int:
    return sum("/dev/zero" in line for line in open("/proc/self/maps"))


async def test_copies_of_evicted_objects_are_unmapped_once_demoted_without_the_garbage_collector(tmp_path):
    # Found by the load probe: every copy out of the arena (an anonymous mapping) stayed
    # alive until a full garbage collection — a reference cycle through the executor job's
    # done-callback — and the daemon's RSS grew by ~700 MiB of them under eviction.
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(8 << 20, granularity=4096))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 640 << 20, segment_bytes=8 << 20), keyring=keyring)
    engine = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="test"))
    specs = (TensorSpec("kv", "uint8", (200 * 1024,)),)  # above the inline copy size: copied in the executor
    gc.collect()
    gc.disable()
    try:
        await engine.start()
        before = anonymous_shared_mappings()
        for layer in range(120):  # 24 MiB through an 8 MiB arena: evicted and demoted
            key = StateKey(NS, Kind.KV, layer, CHAIN[0], 0, 16)
            await engine.put(PutRequest("default", key, Provenance(f"r{layer}"), specs), bytes(200 * 1024))
        for _ in range(100):  # bounded: the executor's done-callbacks run on the loop
            await asyncio.sleep(0)
        assert host.stats().evictions > 60
        assert anonymous_shared_mappings() == before
    finally:
        gc.enable()
        await engine.close()


class EvictionCountingHostTier(HostTier):
    """A real host tier that records how many of its evictions ran at the same time."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.running = self.most_at_once = 0

    async def evict_sparing_copies(self, need_bytes: int, is_held_below):
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            return await super().evict_sparing_copies(need_bytes, is_held_below)
        finally:
            self.running -= 1


async def test_puts_that_need_room_at_the_same_time_share_one_eviction(tmp_path):
    # Found by the load probe: 48 clients putting into a full arena each evicted (copied out)
    # a whole watermark band of the same victims at once; the daemon's RSS peaked at 1.1 GiB.
    keyring = Keyring.generate()
    host = EvictionCountingHostTier(HostTierOptions(8 << 20, granularity=4096,
                                                    inline_copy_bytes=0))  # copies in the executor
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 640 << 20, segment_bytes=8 << 20), keyring=keyring)
    engine = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="test"))
    specs = (TensorSpec("kv", "uint8", (200 * 1024,)),)

    def request(layer: int) -> PutRequest:
        return PutRequest("default", StateKey(NS, Kind.KV, layer, CHAIN[0], 0, 16), Provenance(f"r{layer}"), specs)

    await engine.start()
    try:
        for layer in range(36):  # the arena up to its high watermark
            await engine.put(request(layer), bytes(200 * 1024))
        puts = await asyncio.gather(*(engine.put(request(100 + i), bytes(200 * 1024)) for i in range(16)))
        assert all(put.tier == "host" for put in puts)
        assert host.stats().evictions > 0
        assert host.most_at_once == 1
    finally:
        await engine.close()


async def test_a_state_id_issued_for_another_stream_is_misrouted_even_when_its_object_is_gone(engine):
    mine = (await engine.put(*ssm_put(request="req-a"))).ref
    theirs = (await engine.put(*ssm_put(request="req-b", seed=2))).ref
    await engine.delete("default", theirs)
    crossed = mine.__class__(mine.key, mine.request_id, mine.step, theirs.state_id, mine.version)
    with pytest.raises(MisroutedState):
        await engine.load(LoadRequest("default", NS, ref=crossed), owner="c1")
    assert rejections(engine.test_metrics, "misrouted") == 1


async def test_a_tenant_past_its_quota_spills_to_the_next_tier_then_is_refused(tmp_path):
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(1 << 20))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    one_object = 20 * 1024
    quotas = {"small": {"host": one_object, "disk": one_object}}
    engine = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(quotas=quotas), arena=host)
    await engine.start()
    try:
        first = await engine.put(*ssm_put(layer=0, tenant="small"))
        second = await engine.put(*ssm_put(layer=1, tenant="small"))
        assert (first.tier, second.tier) == ("host", "disk")
        with pytest.raises(QuotaExceeded):
            await engine.put(*ssm_put(layer=2, tenant="small"))
        assert (host.stats().objects, disk.stats().objects) == (1, 1)  # nothing stored for the refusal
        await engine.delete("small", first.ref)
        assert (await engine.put(*ssm_put(layer=3, tenant="small"))).tier == "host"
    finally:
        await engine.close()


async def test_a_format_1_object_on_disk_is_refused_with_its_reason_and_dropped_never_misread(engine):
    # format 1 bound keyed digests; its header, correctly signed, still parses with format 3's
    # offsets: it must be refused (UnsupportedFormat, saying why), not read
    req, data = ssm_put()
    put = await engine.put(req, data)
    disk, blob, meta = await _take_disk_copy(engine, put.ref.state_id)
    header_len = meta.header_len
    blob[4:6] = (1).to_bytes(2, "little")  # format 1, re-signed by the key that signed it
    signer = engine.keyring.active
    sig_len = signer.alg.signature_bytes
    blob[header_len - sig_len : header_len] = signer.sign(bytes(blob[: header_len - sig_len]))
    await engine.placement.store_in(disk, [bytes(blob)], meta)
    with pytest.raises(UnsupportedFormat, match="keyed payload digests"):
        await engine.load(LoadRequest("default", NS, ref=put.ref), owner="c1")
    assert rejections(engine.test_metrics, "unsupported_format") == 1
    assert not await disk.contains(put.ref.state_id)  # dropped as damage
