"""Issue 12: what the engine serves, and to whom, over a real host arena and disk tier.

Stories: a TP=2 lookup with one shard's snapshot missing answers the lower boundary, and a
rank whose shard has gone since the lookup is refused, never handed a recomputed mix; a group
every rank holds the same (stored once, shard 0) is found with its shard count of 1; a
speculative snapshot beside a committed one leaves the committed one served (the skip is
counted); ``publish`` with no cross-node tier is refused before anything is stored, or,
when tolerated, stored locally, said in the reply and counted; INSPECT and VERIFY see only
the asking tenant's objects.
"""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.metrics import Metrics
from statetier.daemon.requests import LoadRequest, LookupRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import CorruptPayload, Forbidden, InvalidRequest, NotFound, Unavailable
from statetier.protocol.groups import LayerGroup
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, new_state_id, prefix_hashes
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import decode_header, seal_object, verify_payload_only
from statetier.tiers.base import ObjectMeta
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.registry import MemoryVersionRegistry
from tests.support.host_tier import offset_in_arena

NS = NamespaceSpec("serving-rules", tp_size=2).namespace()
BOB_NS = NamespaceSpec("serving-rules", tenant="bob").namespace()
SPECS = (TensorSpec("ssm", "float32", (32, 16)),)
CHAIN = prefix_hashes(list(range(64)), 16)
BOUNDS = tuple((16 * (i + 1), CHAIN[i]) for i in range(4))


def data(seed: int) -> bytes:
    return bytes((seed * 13 + i) % 251 for i in range(SPECS[0].nbytes))


def snapshot(layer: int, block: int, *, shard: int = 0, ns=NS) -> StateKey:
    return StateKey(ns, Kind.SSM, layer, CHAIN[block], 0, 16 * (block + 1), shard)


def page(layer: int, block: int, *, shard: int = 0) -> StateKey:
    return StateKey(NS, Kind.KV, layer, CHAIN[block], 16 * block, 16 * (block + 1), shard)


async def build(tmp_path, **options) -> tuple[Engine, Metrics]:
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(8 << 20, pin_memory=False))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    metrics = Metrics()
    engine = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(), metrics=metrics,
                    options=EngineOptions(producer_id="rules", **options), arena=host, write_behind_to=disk)
    await engine.start()
    return engine, metrics


@pytest.fixture
async def engine(tmp_path):
    built, metrics = await build(tmp_path)
    built.test_metrics = metrics
    yield built
    await built.close()


async def put(engine: Engine, key: StateKey, *, request: str = "req", seed: int = 1, tenant: str = "default",
              speculative: bool = False, publish: bool = False, specs: tuple[TensorSpec, ...] = SPECS):
    req = PutRequest(tenant, key, Provenance(request, step=key.token_end), specs, speculative=speculative,
                     publish=publish)
    return await engine.put(req, data(seed))


def counter(metrics: Metrics, name: str, **labels) -> float:
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# -- TP shards -------------------------------------------------------------------------------


async def test_a_tp2_lookup_with_one_shard_missing_answers_the_lower_boundary(engine):
    for shard in (0, 1):
        for block in range(4):
            await put(engine, page(0, block, shard=shard))
        for block in (1, 3):
            await put(engine, snapshot(1, block, shard=shard))
    both = LookupRequest("default", NS, (0,), (1,), BOUNDS, shards=(0, 1), lease=False)
    assert (await engine.lookup(both, owner="c")).tokens == 64

    at_64 = (await engine.lookup(both, owner="c")).objects
    rank1_snapshot = next(ref for ref, _ in at_64 if ref.key.kind is Kind.SSM and ref.key.shard == 1)
    assert await engine.delete("default", rank1_snapshot) >= 1

    answer = await engine.lookup(both, owner="c")
    assert answer.tokens == 32  # rank 0 alone could restore 64; rank 1 only 32
    assert {ref.key.shard for ref, _ in answer.objects} == {0, 1}
    rank0_only = LookupRequest("default", NS, (0,), (1,), BOUNDS, shards=(0,), lease=False)
    assert (await engine.lookup(rank0_only, owner="c")).tokens == 64  # what the old one-shard lookup said


async def test_a_group_every_rank_holds_the_same_is_found_once_with_a_shard_count_of_one(engine):
    """vLLM's ``MambaSpec.tp_replicated``: under a TP=2 namespace, the state saved once, as shard 0."""
    pages, state = LayerGroup(Kind.KV, 0, (0,)), LayerGroup(Kind.SSM, 1, (1,))
    for shard in (0, 1):
        for block in range(4):
            await put(engine, pages.key(NS, CHAIN[block], 16 * block, 16 * (block + 1), shard),
                      specs=(TensorSpec("0.kv", "float32", (32, 16)),))
    await put(engine, state.key(NS, CHAIN[3], 0, 64), specs=(TensorSpec("1.ssm", "float32", (32, 16)),))
    every_shard = LookupRequest("default", NS, (), (), BOUNDS, shards=(0, 1), lease=False, groups=(pages, state))
    assert (await engine.lookup(every_shard, owner="c")).tokens == 0  # shard 1's state was never saved
    once = msgspec.structs.replace(every_shard, group_shards=(2, 1))
    answer = await engine.lookup(once, owner="c")
    assert answer.tokens == 64
    assert sorted((ref.key.kind, ref.key.shard) for ref, _ in answer.objects) == sorted(
        [(Kind.KV, 0)] * 4 + [(Kind.KV, 1)] * 4 + [(Kind.SSM, 0)])
    for bad in ((2,), (2, 0), (2, 3)):  # a count per group, each 1 … tp_size
        with pytest.raises(InvalidRequest, match="shard count"):
            await engine.lookup(msgspec.structs.replace(every_shard, group_shards=bad), owner="c")


async def test_a_rank_whose_shard_went_since_the_lookup_is_refused(engine):
    for shard in (0, 1):
        await put(engine, snapshot(1, 3, shard=shard))
    found = await engine.lookup(LookupRequest("default", NS, (), (1,), BOUNDS, shards=(0, 1), lease=False),
                                owner="c")
    assert found.tokens == 64
    refs = {ref.key.shard: ref for ref, _ in found.objects}
    await engine.delete("default", refs[1])
    served = await engine.load(LoadRequest("default", NS, ref=refs[0]), owner="rank0")
    await engine.release(served.lease_id, "rank0")
    with pytest.raises(NotFound):  # fails closed: rank 1 recomputes, and so must the request
        await engine.load(LoadRequest("default", NS, ref=refs[1]), owner="rank1")


# -- speculative candidates ------------------------------------------------------------------


async def test_a_speculative_snapshot_beside_a_committed_one_leaves_the_committed_one_served(engine):
    key = snapshot(1, 3)
    committed = await put(engine, key, request="target-model", seed=1)
    drafted = await put(engine, key, request="draft-model", seed=2, speculative=True)  # the newer one
    assert drafted.ref.state_id != committed.ref.state_id

    served = await engine.load(LoadRequest("default", NS, key=key), owner="c")
    assert served.header.state_id == committed.ref.state_id and bytes(served.payload) == data(1)
    await engine.release(served.lease_id, "c")
    assert counter(engine.test_metrics, "statetier_skipped_candidates_total", reason="speculative") == 1

    hit = await engine.lookup(LookupRequest("default", NS, (), (1,), BOUNDS, shards=(0,), lease=False), owner="c")
    assert hit.tokens == 64 and [ref.state_id for ref, _ in hit.objects] == [committed.ref.state_id]

    allowed = await engine.load(LoadRequest("default", NS, key=key, allow_speculative=True), owner="c")
    assert allowed.header.state_id == drafted.ref.state_id  # a draft worker may still have its own
    await engine.release(allowed.lease_id, "c")


async def test_only_a_speculative_snapshot_is_no_hit(engine):
    key = snapshot(1, 2)
    await put(engine, key, request="draft-model", speculative=True)
    with pytest.raises(NotFound):
        await engine.load(LoadRequest("default", NS, key=key), owner="c")
    assert counter(engine.test_metrics, "statetier_rejections_total", reason="position") == 0


async def test_a_damaged_newest_candidate_is_skipped_for_the_next_valid_one(engine):
    key = snapshot(1, 3)
    older = await put(engine, key, request="first", seed=1)
    newer = await put(engine, key, request="second", seed=2)
    assert await engine.placement.flush_write_behind(10)
    await engine.tiers[1].delete(newer.ref.state_id)  # its arena copy is the only one
    offset = await offset_in_arena(engine.arena, newer.ref.state_id) \
        + (await engine.arena.get_meta(newer.ref.state_id)).size - 1
    arena = engine.arena.arena_view
    arena[offset] ^= 0x01
    arena.release()

    # the arena is memory only the daemon writes: a load serves it without a digest pass, the
    # client finds the damage where the bytes land and asks again with a full check
    served = await engine.load(LoadRequest("default", NS, key=key), owner="c")
    assert served.header.state_id == newer.ref.state_id
    with pytest.raises(CorruptPayload):
        verify_payload_only(served.header, served.payload)
    await engine.release(served.lease_id, "c")
    served = await engine.load(LoadRequest("default", NS, key=key, full_check=True), owner="c")
    assert served.header.state_id == older.ref.state_id
    await engine.release(served.lease_id, "c")
    assert counter(engine.test_metrics, "statetier_skipped_candidates_total", reason="damaged") == 1
    assert counter(engine.test_metrics, "statetier_rejections_total", reason="corrupt_payload") == 1


# -- publish ---------------------------------------------------------------------------------


async def test_publish_without_a_cross_node_tier_is_refused_and_nothing_is_stored(engine):
    with pytest.raises(Unavailable, match="nothing was stored or published"):
        await put(engine, snapshot(1, 3), publish=True)
    assert engine.arena.stats().objects == 0


async def test_publish_without_a_cross_node_tier_when_tolerated_says_so_and_counts(tmp_path):
    engine, metrics = await build(tmp_path, tolerate_unpublished=True)
    try:
        result = await put(engine, snapshot(1, 3), publish=True)
        assert result.published is False and result.tier == "host"
        assert counter(metrics, "statetier_unpublished_puts_total") == 1
        assert (await put(engine, snapshot(2, 3))).published is False  # not asked: not counted
        assert counter(metrics, "statetier_unpublished_puts_total") == 1
    finally:
        await engine.close()


# -- tenants ---------------------------------------------------------------------------------


async def test_a_tenant_inspecting_another_tenants_object_is_refused(engine):
    alices = await put(engine, snapshot(1, 3), tenant="alice")
    bobs = await put(engine, snapshot(1, 3, ns=BOB_NS), tenant="bob")
    assert (await engine.inspect("alice", alices.ref.state_id))["header"]["state_id"] == alices.ref.state_id.hex()
    with pytest.raises(Forbidden):
        await engine.inspect("bob", alices.ref.state_id)
    with pytest.raises(Forbidden):
        await engine.inspect("alice", bobs.ref.state_id)


async def test_verify_reports_only_the_asking_tenants_objects(engine):
    await put(engine, snapshot(1, 3), tenant="alice")
    await put(engine, snapshot(2, 3), tenant="alice")
    await put(engine, snapshot(1, 3, ns=BOB_NS), tenant="bob")
    assert await engine.placement.flush_write_behind(10)
    assert (await engine.verify_all("alice"))["checked"] == 4  # two objects, host and disk
    assert (await engine.verify_all("bob"))["checked"] == 2


async def test_the_speculative_flag_survives_a_disk_restart(tmp_path):
    """The disk index keeps the flag (bit 7 of its kind byte), so a restarted daemon still
    skips a speculative snapshot without reading it."""
    keyring = Keyring.generate()
    key = snapshot(1, 3)
    blob = seal_object(key, Provenance("draft-model", 64, "rules", 1), [(SPECS[0], data(1))], keyring=keyring,
                       state_id=new_state_id(), version=1, contains_speculative=True)
    meta = ObjectMeta.from_header(decode_header(blob))
    assert meta.speculative
    for round_ in range(2):
        disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
        await disk.start()
        try:
            if round_ == 0:
                ticket = await disk.prepare_store(meta)
                await disk.write(ticket, [blob])
                await disk.complete_store(ticket, True)
            assert await disk.find_by_key(key.digest()) == [meta]
        finally:
            await disk.close()
