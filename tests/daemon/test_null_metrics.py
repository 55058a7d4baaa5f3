"""An engine without metrics holds ``NullMetrics``: the same calls, nothing counted, no None checks.

One story — puts that overflow the host arena (demotions), loads from both tiers
(promotions), a miss, a stale ref (a rejection), a lookup, a purge — runs once with
``Metrics`` and once without: the answers are the same, and the real metrics show that
every counting call of the story was made.
"""

from __future__ import annotations

import inspect

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.metrics import Metrics, NullMetrics
from statetier.daemon.requests import LoadRequest, LookupRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import NotFound, StaleState
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, prefix_hashes
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import layout_payload
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.registry import MemoryVersionRegistry

NS = NamespaceSpec("null-metrics", kv_dtype="bfloat16").namespace()
SPECS = (TensorSpec("conv", "bfloat16", (3, 256)), TensorSpec("ssm", "float32", (256, 16)))
CHAIN = prefix_hashes(list(range(64)), 16)
LAYERS = 5


def put_of(layer: int, version: int | None = None) -> tuple[PutRequest, bytes]:
    key = StateKey(NS, Kind.SSM, layer, CHAIN[3], 0, 64)
    payload = bytes((layer * 7 + (version or 0) + i) % 251 for i in range(layout_payload(SPECS).payload_len))
    return PutRequest("default", key, Provenance("req", step=3), SPECS, version=version), payload


def public_methods(cls: type) -> dict:
    return {name: member for name, member in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_null_metrics_has_every_method_of_metrics_with_its_signature() -> None:
    public = public_methods(Metrics)
    assert len(public) == 19 and public.keys() == public_methods(NullMetrics).keys()
    for name, member in public.items():
        assert inspect.signature(getattr(NullMetrics, name)) == inspect.signature(member), name
        assert getattr(NullMetrics(), name)(*[None] * (len(inspect.signature(member).parameters) - 1)) is None


async def story(tmp_path, metrics: Metrics | None) -> list:
    keyring = Keyring.generate()
    host = HostTier(HostTierOptions(3 * 20 * 1024, granularity=4096))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    engine = Engine([host, disk], keyring=keyring, registry=MemoryVersionRegistry(), metrics=metrics,
                    options=EngineOptions(producer_id="test"), arena=host, write_behind_to=disk)
    await engine.start()
    try:
        assert isinstance(engine.stack.metrics, Metrics if metrics is not None else NullMetrics)
        seen: list = []
        refs = [(await engine.put(*put_of(layer))).ref for layer in range(LAYERS)]
        for ref in refs:  # the first ones were demoted: loaded from disk, promoted back
            result = await engine.load(LoadRequest("default", NS, ref=ref), owner="c")
            seen.append(bytes(result.payload) == put_of(ref.key.layer)[1])
            await engine.release(result.lease_id, "c")
        # the arena is full: those promotions were left to the write-behind worker (a load never evicts)
        assert await engine.placement.flush_write_behind(10)
        with pytest.raises(NotFound):
            await engine.load(LoadRequest("default", NS, key=StateKey(NS, Kind.SSM, 9, CHAIN[3], 0, 64)), owner="c")
        newer = await engine.put(*put_of(0, version=refs[0].version + 1))
        with pytest.raises(StaleState):
            await engine.load(LoadRequest("default", NS, ref=refs[0]), owner="c")
        found = await engine.lookup(LookupRequest("default", NS, (), tuple(range(LAYERS)), ((64, CHAIN[3]),),
                                                  lease=False), owner="c")
        seen += [newer.ref.version, found.tokens]
        purged = await engine.purge("default", namespace=NS)
        seen.append(sorted(purged))
        return seen
    finally:
        await engine.close()


def counted(metrics: Metrics) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def test_an_engine_without_metrics_answers_exactly_as_one_with_them(tmp_path) -> None:
    metrics = Metrics()
    with_metrics = await story(tmp_path / "a", metrics)
    assert with_metrics == await story(tmp_path / "b", None)
    assert with_metrics[:LAYERS] == [True] * LAYERS and with_metrics[LAYERS:LAYERS + 2] == [2, 64]
    totals = counted(metrics)
    # every counting call of the story was made (and the null object took the same calls)
    for name in ("statetier_hits_total", "statetier_misses_total", "statetier_demotions_total",
                 "statetier_promotions_total", "statetier_rejections_total", "statetier_lookup_seconds_count",
                 "statetier_purged_objects_total", "statetier_operations_total"):
        assert totals.get(name, 0) >= 1, name
