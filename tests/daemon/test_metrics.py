"""Metrics: each method moves exactly its series; tier gauges are read from live stats at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from statetier.daemon.metrics import Metrics
from statetier.tiers.base import TierStats


def scrape(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Every sample of one scrape: (sample name, sorted labels) → value."""
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_fresh_registry_each_time_never_the_global_one() -> None:
    from prometheus_client import REGISTRY

    first, second = Metrics(), Metrics()  # would raise "Duplicated timeseries" if shared
    assert first.registry is not REGISTRY and first.registry is not second.registry
    injected = CollectorRegistry()
    assert Metrics(injected).registry is injected


def test_operations_bytes_and_latency() -> None:
    metrics = Metrics()
    metrics.observe_op("host", "kv", "put", 4096, 0.0002)
    metrics.observe_op("host", "kv", "put", 1000, 0.003)
    metrics.observe_op("disk", "ssm", "load", 777, 0.5)
    s = scrape(metrics)
    assert value(s, "statetier_operations_total", tier="host", kind="kv", op="put") == 2
    assert value(s, "statetier_bytes_total", tier="host", kind="kv", op="put") == 5096
    assert value(s, "statetier_operations_total", tier="disk", kind="ssm", op="load") == 1
    assert value(s, "statetier_bytes_total", tier="disk", kind="ssm", op="load") == 777
    assert value(s, "statetier_operations_total", tier="disk", kind="kv", op="load") is None
    assert value(s, "statetier_operation_seconds_count", tier="host", kind="kv", op="put") == 2
    assert value(s, "statetier_operation_seconds_sum", tier="host", kind="kv", op="put") == pytest.approx(0.0032)
    assert value(s, "statetier_operation_seconds_bucket", tier="host", kind="kv", op="put", le="0.00025") == 1
    assert value(s, "statetier_operation_seconds_bucket", tier="host", kind="kv", op="put", le="0.005") == 2
    assert value(s, "statetier_operation_seconds_bucket", tier="disk", kind="ssm", op="load", le="0.25") == 0
    assert value(s, "statetier_operation_seconds_bucket", tier="disk", kind="ssm", op="load", le="0.5") == 1


def test_counters_move_by_exactly_what_was_counted() -> None:
    metrics = Metrics()
    metrics.count_hit("host", "kv")
    metrics.count_hit("host", "kv")
    metrics.count_hit("redis", "ssm")
    metrics.count_miss("kv")
    metrics.count_rejection("bad_signature")
    metrics.count_rejection("stale")
    metrics.count_rejection("stale")
    metrics.count_purged("redis", 5)
    metrics.count_demotion("host", "disk", 3)
    metrics.count_promotion("disk", "host")
    metrics.count_busy()
    metrics.count_busy()
    metrics.count_error("not_found")
    metrics.count_auth_failure("unauthorized")
    s = scrape(metrics)
    assert value(s, "statetier_hits_total", tier="host", kind="kv") == 2
    assert value(s, "statetier_hits_total", tier="redis", kind="ssm") == 1
    assert value(s, "statetier_misses_total", kind="kv") == 1
    assert value(s, "statetier_rejections_total", reason="bad_signature") == 1
    assert value(s, "statetier_rejections_total", reason="stale") == 2
    assert value(s, "statetier_purged_objects_total", tier="redis") == 5
    assert value(s, "statetier_misses_total", kind="ssm") == 0  # at 0 from the start, beside kv's 1
    assert not any(name == "statetier_evicted_objects_total" for name, _ in s)  # one eviction counter: the tiers'
    assert value(s, "statetier_demotions_total", src="host", dst="disk") == 3
    assert value(s, "statetier_promotions_total", src="disk", dst="host") == 1
    assert value(s, "statetier_busy_total") == 2
    assert value(s, "statetier_errors_total", reason="not_found") == 1
    assert value(s, "statetier_auth_failures_total", reason="unauthorized") == 1


def test_lookup_histograms() -> None:
    metrics = Metrics()
    metrics.observe_lookup(0, 0.0001)
    metrics.observe_lookup(1024, 0.002)
    s = scrape(metrics)
    assert value(s, "statetier_lookup_hit_tokens_count") == 2
    assert value(s, "statetier_lookup_hit_tokens_sum") == 1024
    assert value(s, "statetier_lookup_hit_tokens_bucket", le="0.0") == 1
    assert value(s, "statetier_lookup_hit_tokens_bucket", le="1024.0") == 2
    assert value(s, "statetier_lookup_seconds_count") == 2
    assert value(s, "statetier_lookup_seconds_sum") == pytest.approx(0.0021)


def test_redis_up_appears_once_set() -> None:
    metrics = Metrics()
    assert value(scrape(metrics), "statetier_redis_up") is None  # no Redis tier: no false alarm
    metrics.set_redis_available(True)
    assert value(scrape(metrics), "statetier_redis_up") == 1
    metrics.set_redis_available(False)
    assert value(scrape(metrics), "statetier_redis_up") == 0


def test_tier_gauges_are_read_at_scrape_time() -> None:
    metrics = Metrics()
    assert value(scrape(metrics), "statetier_tier_used_bytes", tier="host") is None  # not tracked yet

    tiers = [
        TierStats(tier="host", objects=3, bytes_used=3000, capacity=10000, leases=1, inflight=2, evictions=4),
        TierStats(tier="disk", objects=10, bytes_used=50000, capacity=1 << 30, leases=0, inflight=0,
                  compactions_run=2, compactions_blocked=1, bytes_reclaimed=8192),
    ]
    daemon = {"connections": 2, "inflight_requests": 5, "budget_bytes_in_use": 65536, "budget_bytes_limit": 1 << 30,
              "budget_waiters": 3,
              "leases": 1, "not_a_gauge": "text"}
    metrics.track(lambda: list(tiers), lambda: dict(daemon))

    s = scrape(metrics)
    assert value(s, "statetier_tier_used_bytes", tier="host") == 3000
    assert value(s, "statetier_tier_capacity_bytes", tier="host") == 10000
    assert value(s, "statetier_tier_objects", tier="host") == 3
    assert value(s, "statetier_leases", tier="host") == 1
    assert value(s, "statetier_inflight_transfers", tier="host") == 2
    assert value(s, "statetier_evictions_total", tier="host") == 4
    assert value(s, "statetier_tier_used_bytes", tier="disk") == 50000
    assert value(s, "statetier_tier_capacity_bytes", tier="disk") == 1 << 30
    assert value(s, "statetier_compactions_total", tier="disk") == 2
    assert value(s, "statetier_compactions_blocked_total", tier="disk") == 1
    assert value(s, "statetier_compaction_reclaimed_bytes_total", tier="disk") == 8192
    assert value(s, "statetier_connections") == 2
    assert value(s, "statetier_inflight_requests") == 5
    assert value(s, "statetier_budget_in_use_bytes") == 65536
    assert value(s, "statetier_budget_capacity_bytes") == 1 << 30
    assert value(s, "statetier_budget_waiters") == 3
    assert value(s, "statetier_client_leases") == 1
    assert value(s, "statetier_reservations") is None  # zero-copy reservations are gone (issue 21)

    # The tiers change; the next scrape shows it without anyone calling Metrics.
    tiers[0] = TierStats(tier="host", objects=1, bytes_used=1000, capacity=10000, leases=0, inflight=0, evictions=6)
    tiers.append(TierStats(tier="redis", objects=7, bytes_used=7, capacity=0, leases=0, inflight=1))
    daemon["connections"] = 0
    s = scrape(metrics)
    assert value(s, "statetier_tier_used_bytes", tier="host") == 1000
    assert value(s, "statetier_tier_objects", tier="host") == 1
    assert value(s, "statetier_evictions_total", tier="host") == 6
    assert value(s, "statetier_tier_objects", tier="redis") == 7
    assert value(s, "statetier_inflight_transfers", tier="redis") == 1
    assert value(s, "statetier_connections") == 0


def test_a_failing_stats_callable_costs_only_its_families() -> None:
    metrics = Metrics()

    def broken() -> list[TierStats]:
        raise RuntimeError("tier went away")

    metrics.track(broken, lambda: {"connections": 3})
    metrics.count_busy()
    s = scrape(metrics)
    assert value(s, "statetier_connections") == 3
    assert value(s, "statetier_busy_total") == 1
    assert value(s, "statetier_scrape_errors_total") == 1
    assert not any(name == "statetier_tier_used_bytes" for name, _ in s)


def test_metric_names_end_in_units() -> None:
    metrics = Metrics()
    metrics.track(lambda: [TierStats("host", 0, 0, 1, 0, 0)], lambda: {"connections": 0, "leases": 0})
    metrics.set_redis_available(True)
    families = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    names = {family.name for family in families}
    assert all(name.startswith(("statetier_", "process_")) for name in names)
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "process_start_time_seconds"} <= names
    for family in families:
        if family.type == "counter":
            assert all(sample.name.endswith(("_total", "_created")) for sample in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_tokens")), family.name


def test_lookups_count_requested_and_restored_tokens() -> None:
    metrics = Metrics()
    metrics.observe_lookup(1024, 0.001, requested=4096)
    metrics.observe_lookup(0, 0.001, requested=512)
    s = scrape(metrics)
    assert value(s, "statetier_lookup_requested_tokens_total") == 4608
    assert value(s, "statetier_lookup_restored_tokens_total") == 1024


def test_build_info_names_the_release_the_format_and_the_protocols() -> None:
    from statetier import __version__
    from statetier.protocol.frames import PROTOCOL_VERSIONS
    from statetier.protocol.sealed_format import FORMAT_VERSION

    s = scrape(Metrics())
    assert value(s, "statetier_build_info", version=__version__, format=str(FORMAT_VERSION),
                 protocols=",".join(map(str, PROTOCOL_VERSIONS))) == 1


def test_what_stats_already_knew_is_exported_at_scrape_time() -> None:
    metrics = Metrics()
    disk = TierStats(tier="disk", objects=1, bytes_used=10, capacity=100, leases=0, inflight=0,
                     extra={"recovery_dropped": 3, "recovery_unverified": 2, "checkpoint_failures": 1,
                            "dead_bytes": 4096})
    daemon = {"write_behind_pending": 7, "write_behind_limit": 256,
              "tenants": {"a": {"host": {"used": 100, "quota": 1000}, "disk": {"used": 5, "quota": None}}}}
    metrics.track(lambda: [TierStats("host", 0, 0, 1, 0, 0), disk], lambda: dict(daemon))
    s = scrape(metrics)
    assert value(s, "statetier_recovery_dropped_objects", tier="disk") == 3
    assert value(s, "statetier_recovery_unverified_objects", tier="disk") == 2
    assert value(s, "statetier_checkpoint_failures_total", tier="disk") == 1
    assert value(s, "statetier_segment_dead_bytes", tier="disk") == 4096
    assert value(s, "statetier_recovery_dropped_objects", tier="host") is None  # the host tier has no recovery
    assert value(s, "statetier_write_behind_pending") == 7 and value(s, "statetier_write_behind_capacity") == 256
    assert value(s, "statetier_tenant_used_bytes", tenant="a", tier="host") == 100
    assert value(s, "statetier_tenant_quota_bytes", tenant="a", tier="host") == 1000
    assert value(s, "statetier_tenant_used_bytes", tenant="a", tier="disk") == 5
    assert value(s, "statetier_tenant_quota_bytes", tenant="a", tier="disk") is None


def test_the_peer_tiers_faults_are_one_counter_by_reason_every_reason_at_zero() -> None:
    from statetier.tiers.peer.faults import REASONS, PeerFaults

    faults = PeerFaults()
    faults.count("redialled", "peer %s: test", "127.0.0.1:1")
    peer = TierStats("peer", 0, 0, 0, 0, 0, extra={"faults": faults.snapshot(), "owners_fenced": 2})
    metrics = Metrics()
    metrics.track(lambda: [TierStats("host", 0, 0, 1, 0, 0), peer], dict)
    s = scrape(metrics)
    assert {reason: value(s, "statetier_peer_faults_total", reason=reason) for reason in REASONS} == \
        {reason: (1 if reason == "redialled" else 0) for reason in REASONS}
    assert value(s, "statetier_peer_owners_fenced", tier="peer") == 2
    assert value(s, "statetier_peer_owners_fenced", tier="host") is None
