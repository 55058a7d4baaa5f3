"""Issue 12: every mix-up gets its DESIGN §4 reason on every tier, never ``CorruptPayload``.

A buggy connector writes the bytes of an intact, correctly signed object B under the key
of object A, on the host arena, the disk tier, Redis and Redis Cluster; with A's index
entry / manifest left as it was, and with B's rewritten over it. Loading A by its ref must
raise exactly the error DESIGN §4 gives for B-instead-of-A, move exactly that reason of
``statetier_rejections_total``, leave every damage counter alone and the copy where it is
(it is evidence, not damage: ``daemon.engine.serving.CopyServer.serve``). Real damage (a flipped payload bit, a
truncated object) written the same ways is still ``CorruptPayload`` / ``TruncatedState``,
counted as damage and removed.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import redis
import redis.cluster

from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.metrics import Metrics
from statetier.daemon.requests import LoadRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import (
    CorruptPayload,
    FingerprintMismatch,
    MisroutedState,
    NamespaceMismatch,
    PlacementMismatch,
    PositionMismatch,
    RejectedState,
    StaleState,
    TruncatedState,
)
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, StateRef, new_state_id, prefix_hashes
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import decode_header, seal_object, verify_payload_only
from statetier.tiers.base import ObjectMeta
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.redis.layout import Manifest, RedisKeys
from statetier.tiers.registry import MemoryVersionRegistry
from tests.support.host_tier import offset_in_arena

NS = NamespaceSpec("mixup-model").namespace()
OTHER_NS = NamespaceSpec("mixup-model", revision="other-weights").namespace()
SPECS = (TensorSpec("conv", "float32", (4, 64)), TensorSpec("ssm", "float32", (64, 16)))
CHAIN = prefix_hashes(list(range(64)), 16)
OTHER_CHAIN = prefix_hashes(list(range(100, 164)), 16)
TIERS = ("host", "disk", "redis", "redis-cluster")
DAMAGE_REASONS = ("truncated", "malformed", "bad_signature", "unsupported_format", "corrupt_payload")

A_KEY = StateKey(NS, Kind.SSM, 1, CHAIN[3], 0, 64)


def payload(seed: int) -> bytes:
    size = 4 * 64 * 4 + 64 * 16 * 4
    return bytes((seed * 37 + i) % 251 for i in range(size))


# (name, B's key, B's request id, expected error). A is ``A_KEY`` of request "req-a".
MIXUPS = [
    ("another_prompt", dataclasses.replace(A_KEY, prefix_hash=OTHER_CHAIN[3]), "req-b", PositionMismatch),
    ("another_request_same_tokens", A_KEY, "req-b", FingerprintMismatch),
    ("k_tokens_early", dataclasses.replace(A_KEY, prefix_hash=CHAIN[2], token_end=48), "req-a", PositionMismatch),
    ("one_token_late", dataclasses.replace(A_KEY, token_end=65), "req-a", PositionMismatch),
    ("neighbouring_layer", dataclasses.replace(A_KEY, layer=2), "req-a", PlacementMismatch),
    ("another_tp_shard", dataclasses.replace(A_KEY, shard=1), "req-a", PlacementMismatch),
    ("kv_instead_of_ssm", dataclasses.replace(A_KEY, kind=Kind.KV), "req-a", PlacementMismatch),
    ("another_model", dataclasses.replace(A_KEY, namespace=OTHER_NS), "req-a", NamespaceMismatch),
    ("a_smaller_layer", dataclasses.replace(A_KEY, layer=3), "req-a", PlacementMismatch),  # other shapes: fewer bytes
    ("an_older_version", A_KEY, "req-a", StaleState),  # B is version 1 of A's stream, A version 2
    ("a_twin_state_id", A_KEY, "req-a", MisroutedState),  # A's identity and version, another state_id
]


# -- the tiers, each under an engine ---------------------------------------------------------


@dataclasses.dataclass
class Bench:
    engine: Engine
    metrics: Metrics
    tier: object
    raw: object = None  # a redis-py client on the tier's server (Redis tiers)
    prefix: str = ""

    def rejections(self) -> dict[str, float]:
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(generate_latest(self.metrics.registry).decode()):
            for sample in family.samples:
                if sample.name == "statetier_rejections_total":
                    out[sample.labels["reason"]] = sample.value
        return out

    def damage_dropped(self) -> int:
        return self.tier.stats().extra.get("corrupt_dropped", 0)


@pytest.fixture(params=TIERS)
async def bench(request, tmp_path):
    keyring = Keyring.generate()
    kind, raw, prefix = request.param, None, ""
    if kind == "host":
        tier = HostTier(HostTierOptions(4 << 20, pin_memory=False))
    elif kind == "disk":
        tier = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    else:
        server = request.getfixturevalue("redis_cluster" if kind == "redis-cluster" else "redis_server")
        prefix = f"mixup-{uuid.uuid4().hex[:10]}"
        tier = RedisTier(RedisTierOptions(server.url, cluster=kind == "redis-cluster", key_prefix=prefix),
            keyring=keyring)
        raw = (redis.cluster.RedisCluster.from_url(server.url) if kind == "redis-cluster"
               else redis.Redis.from_url(server.url))
    metrics = Metrics()
    engine = Engine([tier], keyring=keyring, registry=MemoryVersionRegistry(), metrics=metrics,
                    options=EngineOptions(producer_id="mixups"), arena=tier if kind == "host" else None)
    await engine.start()
    yield Bench(engine, metrics, tier, raw, prefix)
    await engine.close()
    if raw is not None:
        for key in list(raw.scan_iter(match=f"{prefix}:*", count=500)) + list(
                raw.scan_iter(match=f"{{{prefix}}}:*", count=500)):
            raw.delete(key)
        raw.close()


SMALL_SPECS = (TensorSpec("conv", "float32", (4, 32)), TensorSpec("ssm", "float32", (32, 16)))


async def put(bench: Bench, key: StateKey, request_id: str, seed: int) -> StateRef:
    specs = SMALL_SPECS if key.layer == 3 else SPECS
    data = payload(seed)[: sum(spec.nbytes for spec in specs)]
    result = await bench.engine.put(PutRequest("default", key, Provenance(request_id, step=3), specs), data)
    return result.ref


async def stored_blob(bench: Bench, state_id: bytes) -> bytes:
    lease = await bench.tier.prepare_load(state_id, owner="test")
    try:
        return bytes(await bench.tier.read(lease))
    finally:
        await bench.tier.complete_load(lease)


async def plant(bench: Bench, under: StateRef, blob: bytes, *, rewrite_index: bool) -> None:
    """Write ``blob`` as the object stored under ``under.state_id``, as a buggy connector does.

    Redis: SET of the chunk key (the manifest stays A's), or of both chunk and manifest (B's
    manifest). Host: written over A's arena region in place (A's index entry unchanged; a
    shorter B leaves A's tail behind it), or stored through the tier with B's index entry
    (its whole ``ObjectMeta``) under A's id. Disk, and damage on the host (an arena region
    cannot shrink in place), through the tier's own store: A's index entry sized for the
    bytes, or B's with A's id.
    """
    oid = under.state_id
    try:
        found = decode_header(blob)
    except RejectedState:  # damage: the index entry keeps A's identity
        found = None
    theirs = ObjectMeta.from_header(found) if found is not None and found.state_id != oid else None
    if bench.raw is not None:
        keys = RedisKeys(bench.prefix)
        bench.raw.set(keys.chunk(oid, 0), blob)
        if rewrite_index:
            manifest = Manifest.decode(bench.raw.get(keys.manifest(oid)))
            manifest = dataclasses.replace(manifest, meta=theirs or manifest.meta, stored_size=len(blob))
            bench.raw.set(keys.manifest(oid), manifest.encode())
        return
    mine = await bench.tier.get_meta(oid)
    if bench.tier.name == "host" and not rewrite_index and theirs is not None and len(blob) <= mine.size:
        offset = await offset_in_arena(bench.tier, oid)
        arena = bench.tier.arena_view
        arena[offset : offset + len(blob)] = blob
        arena.release()
        return
    meta = dataclasses.replace(theirs, object_id=oid) if (rewrite_index and theirs is not None) else mine
    meta = dataclasses.replace(meta, size=len(blob), header_len=found.header_len if found else mine.header_len)
    assert await bench.tier.delete(oid)
    ticket = await bench.tier.prepare_store(meta)
    ok = False
    try:
        await bench.tier.write(ticket, [blob])
        ok = True
    finally:
        await bench.tier.complete_store(ticket, ok)


async def load_a(bench: Bench, ref: StateRef, *, full_check: bool = False):
    return await bench.engine.load(LoadRequest("default", NS, ref=ref, full_check=full_check), owner="consumer")


def moved(before: dict, after: dict) -> dict:
    return {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}


@pytest.mark.parametrize("rewrite_index", [False, True], ids=["bytes-only", "manifest-too"])
@pytest.mark.parametrize("name, b_key, b_request, error", MIXUPS, ids=[m[0] for m in MIXUPS])
async def test_an_intact_object_under_another_key_gets_its_identity_reason(bench, name, b_key, b_request, error,
                                                                           rewrite_index):
    if name == "an_older_version":
        b_ref = await put(bench, b_key, b_request, seed=2)
        a_ref = await put(bench, A_KEY, "req-a", seed=1)
        assert (b_ref.version, a_ref.version) == (1, 2)
        b_blob = await stored_blob(bench, b_ref.state_id)
    elif name == "a_twin_state_id":
        a_ref = await put(bench, A_KEY, "req-a", seed=1)
        b_blob = seal_object(a_ref.key, Provenance("req-a", 3, "mixups", 1), _tensors(3),
                             keyring=bench.engine.keyring, state_id=new_state_id(), version=a_ref.version)
    else:
        a_ref = await put(bench, A_KEY, "req-a", seed=1)
        b_ref = await put(bench, b_key, b_request, seed=2)
        b_blob = await stored_blob(bench, b_ref.state_id)
    await plant(bench, a_ref, b_blob, rewrite_index=rewrite_index)
    before, dropped = bench.rejections(), bench.damage_dropped()

    with pytest.raises(RejectedState) as refused:
        await load_a(bench, a_ref)

    assert type(refused.value) is error, f"{type(refused.value).__name__}: {refused.value}"
    assert moved(before, bench.rejections()) == {error.reason: 1}
    assert bench.damage_dropped() == dropped
    assert await bench.tier.contains(a_ref.state_id)  # left in place: evidence, not damage
    with pytest.raises(RejectedState) as again:  # and never served on a second try either
        await load_a(bench, a_ref)
    assert type(again.value) is error
    report = await bench.engine.verify_all("default")  # statetier verify: reported, not dropped
    assert (report["misfiled"], report["dropped"]) == (1, 0)
    assert await bench.tier.contains(a_ref.state_id)


def _tensors(seed: int) -> list:
    data, out, at = payload(seed), [], 0
    for spec in SPECS:
        out.append((spec, data[at : at + spec.nbytes]))
        at += spec.nbytes
    return out


@pytest.mark.parametrize("rewrite_index", [False, True], ids=["bytes-only", "manifest-too"])
@pytest.mark.parametrize("damage, error", [("flipped_bit", CorruptPayload), ("truncated", TruncatedState)])
async def test_real_damage_is_still_corrupt_or_truncated_and_removed(bench, damage, error, rewrite_index):
    a_ref = await put(bench, A_KEY, "req-a", seed=1)
    blob = bytearray(await stored_blob(bench, a_ref.state_id))
    if damage == "flipped_bit":
        blob[-100] ^= 0x04
    else:
        del blob[-32:]
    await plant(bench, a_ref, bytes(blob), rewrite_index=rewrite_index)
    before, dropped = bench.rejections(), bench.damage_dropped()
    full_check = False
    if damage == "flipped_bit":
        # no tier's payload is digested on a load (the hashing rule, docs/protocol.md §6.1):
        # the client finds the damage where the bytes land, and asks again with a full check
        # (SDK: recheck), which drops the damaged copy
        served = await load_a(bench, a_ref)
        with pytest.raises(CorruptPayload):
            verify_payload_only(served.header, served.payload)
        await bench.engine.release(served.lease_id, "consumer")
        full_check = True

    with pytest.raises(RejectedState) as refused:
        await load_a(bench, a_ref, full_check=full_check)

    assert type(refused.value) is error, f"{type(refused.value).__name__}: {refused.value}"
    assert moved(before, bench.rejections()) == {error.reason: 1}
    if bench.tier.name in ("disk", "redis"):  # the tiers that count what they drop
        assert bench.damage_dropped() == dropped + 1
    assert not await bench.tier.contains(a_ref.state_id)  # damage is removed


async def test_a_mixed_up_arena_copy_leaves_the_genuine_copy_below_served(tmp_path):
    """Host arena above disk: B's bytes under A's id in the arena are refused (counted once),
    left there, and A's genuine write-behind copy on disk is served, never the arena bytes."""
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(4 << 20, pin_memory=False))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    metrics = Metrics()
    engine = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(), metrics=metrics,
                    options=EngineOptions(producer_id="mixups"), arena=host, write_behind_to=disk)
    await engine.start()
    try:
        bench = Bench(engine, metrics, host)
        a_ref = await put(bench, A_KEY, "req-a", seed=1)
        b_ref = await put(bench, dataclasses.replace(A_KEY, layer=2), "req-a", seed=2)
        assert await engine.placement.flush_write_behind(10)
        await plant(bench, a_ref, await stored_blob(bench, b_ref.state_id), rewrite_index=False)
        before = bench.rejections()

        served = await engine.load(LoadRequest("default", NS, ref=a_ref), owner="c")
        assert served.tier == "disk" and served.header.state_id == a_ref.state_id
        assert bytes(served.payload) == payload(1)
        await engine.release(served.lease_id, "c")
        assert moved(before, bench.rejections()) == {"placement": 1}
        assert await host.contains(a_ref.state_id)  # the mixed-up copy stays for inspection
    finally:
        await engine.close()
