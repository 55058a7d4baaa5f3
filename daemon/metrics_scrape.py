"""The metrics read from live stats when Prometheus scrapes (``Metrics.track`` feeds them).

``ScrapeTimeCollector`` — registered once on the daemon's registry; at each scrape it turns
``tier_stats()`` (``TierStats`` per tier) and ``daemon_stats()`` (a dict) into families:

- per tier (``TIER_FAMILIES``, from ``TierStats`` attributes): used and capacity bytes,
  objects, leases, transfers in flight, evictions, compactions run / blocked / bytes reclaimed;
- per tier, from ``TierStats.extra`` where a tier reports it (``TIER_EXTRAS``): leases
  expired, lease violations, checkpoint failures, dead segment bytes, and what the last start
  dropped or could not verify (``recovery_dropped``, ``recovery_unverified``), the owners the
  peer tier fences (``owners_fenced``);
- the peer tier's faults (``TierStats.extra["faults"]``, ``tiers.peer.faults``):
  ``statetier_peer_faults_total{reason}``, every reason at 0 from the start;
- daemon-wide gauges (``DAEMON_GAUGES``, from ``daemon_stats()`` keys): connections,
  requests, byte budget, client leases, the write-behind backlog and its bound;
- per tenant and tier (``daemon_stats()["tenants"]``: ``{tenant: {tier: {"used", "quota"}}}``):
  ``statetier_tenant_used_bytes`` and ``statetier_tenant_quota_bytes`` (where a quota is set);
- the KV event streams (``event_stats()``: ``daemon.events.EventPublisher.stats``):
  ``statetier_events_published_total`` (events handed to the sockets),
  ``statetier_events_dropped_total`` (events the publisher thread could not take: never sent,
  not in the replay ring), ``statetier_event_overflows_total`` (a subscriber reached its
  high-water mark: it misses batches until it reads again, the others get them, it replays the
  gap), ``statetier_event_subscribers`` (subscriptions open);
- ``statetier_redis_up`` once ``redis_up`` is set, and ``statetier_scrape_errors_total``.

Scrapes run on the event loop (``daemon/http.py``), so the stats callables see a consistent
state without locks. A callable that raises costs its families for that scrape only, and is
counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from statetier.tiers.base import TierStats

log = logging.getLogger("statetier.daemon.metrics")

# (metric, type, help, TierStats attribute)
TIER_FAMILIES = (
    ("statetier_tier_used_bytes", "gauge", "Bytes of live objects in the tier.", "bytes_used"),
    ("statetier_tier_capacity_bytes", "gauge", "Capacity of the tier in bytes.", "capacity"),
    ("statetier_tier_objects", "gauge", "Live objects in the tier.", "objects"),
    ("statetier_leases", "gauge", "Leases held on the tier's objects.", "leases"),
    ("statetier_inflight_transfers", "gauge", "Stores and loads in progress in the tier.", "inflight"),
    ("statetier_evictions_total", "counter", "Objects the tier evicted (demoted, or dropped with no tier below).",
     "evictions"),
    ("statetier_compactions_total", "counter", "Compaction passes run.", "compactions_run"),
    ("statetier_compactions_blocked_total", "counter", "Compactions skipped or delayed by a lease.",
     "compactions_blocked"),
    ("statetier_compaction_reclaimed_bytes_total", "counter", "Bytes reclaimed by compaction.", "bytes_reclaimed"),
)

# (metric, type, help, TierStats.extra key): only the tiers that report the key get a sample.
TIER_EXTRAS = (
    ("statetier_leases_expired_total", "counter", "Leases dropped at their deadline.", "leases_expired"),
    ("statetier_lease_violations_total", "counter", "Bytes moved or freed under a lease (must stay 0).",
     "lease_violations"),
    ("statetier_checkpoint_failures_total", "counter", "Index checkpoints that failed (the log still holds the ops; "
     "a restart replays more).", "checkpoint_failures"),
    ("statetier_segment_dead_bytes", "gauge", "Segment file bytes no live object uses (compaction reclaims them).",
     "dead_bytes"),
    ("statetier_recovery_dropped_objects", "gauge", "Index entries the last start dropped (damaged or torn "
     "records: those objects are gone).", "recovery_dropped"),
    ("statetier_recovery_unverified_objects", "gauge", "Logged puts the last start could not verify (never "
     "acknowledged, or damaged since).", "recovery_unverified"),
    ("statetier_peer_nixl_reads_total", "counter", "Peer pulls read with NIXL from the owner's registered arena "
     "(peers.transport = nixl).", "nixl_exposed"),
    ("statetier_peer_nixl_inline_total", "counter", "NIXL pulls the owner answered as bytes on the peer connection "
     "(the object outside its registered arena).", "nixl_inline"),
    ("statetier_peer_nixl_tcp_owner_total", "counter", "NIXL pulls from an owner without NIXL (answered over "
     "the peer connection).", "nixl_tcp_owner"),
    ("statetier_peer_nixl_registered_per_pull_total", "counter", "NIXL pulls into memory outside the registered "
     "arena (registered for that pull alone).", "nixl_registered_per_pull"),
    ("statetier_peer_nixl_metadata_refused_total", "counter", "NIXL agent metadata in the directory refused: "
     "its MAC does not verify under this cluster's keyring.", "nixl_metadata_refused"),
    ("statetier_peer_owners_fenced", "gauge", "Owners whose entries this daemon no longer offers (evidence their "
     "process is gone; lifted when they renew their liveness key).", "owners_fenced"),
)

# (metric, help, daemon_stats key)
DAEMON_GAUGES = (
    ("statetier_connections", "Open client connections.", "connections"),
    ("statetier_inflight_requests", "Requests being served.", "inflight_requests"),
    ("statetier_budget_in_use_bytes", "Byte budget taken by in-flight payloads.", "budget_bytes_in_use"),
    ("statetier_budget_capacity_bytes", "The byte budget.", "budget_bytes_limit"),
    ("statetier_budget_waiters", "Requests waiting for byte budget.", "budget_waiters"),
    ("statetier_client_leases", "Leases held by clients.", "leases"),
    ("statetier_write_behind_pending", "Copies queued for write-behind to the durable tier.", "write_behind_pending"),
    ("statetier_write_behind_capacity", "Copies the write-behind queue holds before puts wait "
     "(limits.write_behind_queue).", "write_behind_limit"),
)


class ScrapeTimeCollector(Collector):
    def __init__(self) -> None:
        self.tier_stats: Callable[[], list[TierStats]] | None = None
        self.daemon_stats: Callable[[], dict] | None = None
        self.event_stats: Callable[[], dict] | None = None
        self.redis_up: bool | None = None
        self.scrape_errors = 0

    def describe(self) -> list[Metric]:
        return []  # families depend on what is tracked; nothing to check at register time

    def collect(self) -> Iterator[Metric]:
        yield from self._tier_families()
        yield from self._daemon_families()
        yield from self._event_families()
        if self.redis_up is not None:
            yield GaugeMetricFamily("statetier_redis_up", "1 when the Redis tier answered, else 0.",
                                    value=int(self.redis_up))
        yield CounterMetricFamily(
            "statetier_scrape_errors_total", "Scrapes where a stats callable raised.", value=self.scrape_errors
        )

    def _tier_families(self) -> Iterator[Metric]:
        stats = self._try_read(self.tier_stats, "tier_stats", list)
        if stats is None:
            return
        for name, kind, doc, attr in TIER_FAMILIES:
            family = _family(kind, name, doc, ["tier"])
            for tier in stats:
                family.add_metric([tier.tier], getattr(tier, attr))
            yield family
        for name, kind, doc, key in TIER_EXTRAS:
            family = _family(kind, name, doc, ["tier"])
            for tier in stats:
                value = tier.extra.get(key)
                if _is_number(value):
                    family.add_metric([tier.tier], value)
            yield family
        yield from _fault_families(stats)

    def _daemon_families(self) -> Iterator[Metric]:
        stats = self._try_read(self.daemon_stats, "daemon_stats", dict)
        if stats is None:
            return
        for name, doc, key in DAEMON_GAUGES:
            value = stats.get(key)
            if _is_number(value):
                yield GaugeMetricFamily(name, doc, value=value)
        tenants = stats.get("tenants")
        if isinstance(tenants, dict):
            used = GaugeMetricFamily("statetier_tenant_used_bytes", "Bytes a tenant's objects take in a tier.",
                                     labels=["tenant", "tier"])
            quota = GaugeMetricFamily("statetier_tenant_quota_bytes", "A tenant's quota in a tier "
                                      "(tenants[].quota_bytes; absent: none).", labels=["tenant", "tier"])
            for tenant, tiers in sorted(tenants.items()):
                for tier, account in sorted(tiers.items()):
                    used.add_metric([tenant, tier], account.get("used", 0))
                    if _is_number(account.get("quota")):
                        quota.add_metric([tenant, tier], account["quota"])
            yield used
            yield quota

    def _event_families(self) -> Iterator[Metric]:
        stats = self._try_read(self.event_stats, "event_stats", dict)
        if stats is None:
            return
        yield CounterMetricFamily("statetier_events_published_total", "KV events sent to subscribers.",
                                  value=stats["published"])
        yield CounterMetricFamily("statetier_events_dropped_total", "KV events the publisher could not take.",
                                  value=stats["dropped"])
        yield CounterMetricFamily("statetier_event_overflows_total",
                                  "Times a subscriber reached its high-water mark and began missing batches.",
                                  value=stats["overflows"])
        yield GaugeMetricFamily("statetier_event_subscribers", "Subscriptions open on the KV event streams.",
                                value=stats["subscriptions"])

    def _try_read(self, source: Callable | None, which: str, into: type):
        """``into(source())``; None without a source, or when it raised: a scrape error,
        counted and logged, that costs only the families read from ``source``."""
        if source is None:
            return None
        try:
            return into(source())
        except Exception:
            self.scrape_errors += 1
            log.exception("metrics: %s() raised during a scrape", which)
            return None


def _fault_families(stats: list[TierStats]) -> Iterator[Metric]:
    """``statetier_peer_faults_total{reason}`` from the tier that counts them (the peer tier)."""
    for tier in stats:
        faults = tier.extra.get("faults")
        if isinstance(faults, dict):
            family = CounterMetricFamily("statetier_peer_faults", "Faults the peer tier met between daemons: "
                                         "connections redialled, pulls retried, owners suspected, fenced, unfenced, "
                                         "entries announced again.", labels=["reason"])
            for reason, count in faults.items():
                family.add_metric([reason], count)
            yield family


def _family(kind: str, name: str, doc: str, labels: list[str]):
    return (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=labels)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
