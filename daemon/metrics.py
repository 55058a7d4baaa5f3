"""Every Prometheus metric of the daemon, declared once, against an injected registry.

``Metrics(registry=None)`` (None → a fresh ``CollectorRegistry``, never the global one).
The engine and the server call the ``observe_*``/``count_*``/``set_*`` methods; the app
calls ``track(tier_stats, daemon_stats)`` once so gauges are read at scrape time.
Labels are bounded: ``tier`` (device, host, disk, redis), ``kind`` (kv, ssm …), ``op``,
``reason`` (an error class's ``.reason``), ``src``/``dst`` (tier names). Never a key or id.

Counted by the daemon as things happen:

    statetier_operations_total{tier,kind,op}        counter    operations finished (put, load, …)
    statetier_bytes_total{tier,kind,op}             counter    payload bytes those operations moved
    statetier_operation_seconds{tier,op}            histogram  latency of one operation
    statetier_hits_total{tier,kind}                 counter    loads served, by the tier that had it
    statetier_misses_total{kind}                    counter    loads no tier could serve
    statetier_rejections_total{reason}              counter    objects refused on load/put (DESIGN §4);
                                                               every RejectedState reason starts at 0
    statetier_skipped_candidates_total{reason}      counter    candidates a load by key or a lookup passed over:
                                                               speculative, stale, damaged, misfiled (all at 0)
    statetier_unpublished_puts_total                counter    puts asked to publish, stored locally only (no
                                                               cross-node tier; ``tolerate_unpublished``)
    statetier_evicted_objects_total{tier}           counter    objects the engine evicted from a tier
    statetier_demotions_total{src,dst}              counter    objects moved to a slower tier
    statetier_promotions_total{src,dst}             counter    objects copied to a faster tier
    statetier_busy_total                            counter    requests answered Busy (byte budget)
    statetier_errors_total{reason}                  counter    requests that ended in an error
    statetier_auth_failures_total{reason}           counter    connections refused at HELLO
    statetier_lookup_seconds                        histogram  latency of a joint-hit lookup
    statetier_lookup_hit_tokens                     histogram  tokens a lookup could restore (0 = miss)

Read at scrape time (``track``; absent until tracked). ``daemon_stats()`` keys:
``connections``, ``inflight_requests``, ``budget_bytes_in_use``, ``budget_bytes_limit``,
``budget_waiters``, ``leases``; a missing key leaves its gauge out.

    statetier_tier_used_bytes{tier}                 gauge      bytes of live objects
    statetier_tier_capacity_bytes{tier}             gauge      capacity
    statetier_tier_objects{tier}                    gauge      live objects
    statetier_leases{tier}                          gauge      leases held on the tier's objects
    statetier_inflight_transfers{tier}              gauge      stores + loads in progress
    statetier_evictions_total{tier}                 counter    evictions the tier reports
    statetier_compactions_total{tier}               counter    compaction passes run
    statetier_compactions_blocked_total{tier}       counter    passes that skipped/waited on a leased segment
    statetier_compaction_reclaimed_bytes_total{tier} counter   bytes compaction gave back
    statetier_leases_expired_total{tier}            counter    leases dropped at their deadline (tiers that
                                                               report ``extra["leases_expired"]``)
    statetier_lease_violations_total{tier}          counter    bytes moved under a lease: must stay 0
                                                               (``extra["lease_violations"]``)
    statetier_redis_up                              gauge      1/0: the Redis tier answered (absent until set)
    statetier_connections                           gauge      open client connections
    statetier_inflight_requests                     gauge      requests being served
    statetier_budget_in_use_bytes                   gauge      byte budget taken by in-flight payloads
    statetier_budget_capacity_bytes                 gauge      the byte budget
    statetier_budget_waiters                        gauge      requests waiting for budget (Busy after a bounded wait)
    statetier_client_leases                         gauge      leases held by clients
    statetier_scrape_errors_total                   counter    scrapes where a stats callable raised

Read at scrape time from the KV event publisher (``track_events``; absent until tracked):

    statetier_events_published_total               counter    events handed to the streams' sockets
    statetier_events_dropped_total                  counter    events the publisher thread could not take
                                                               (never sent, not in the replay ring)
    statetier_event_overflows_total                 counter    a subscriber reached its high-water mark:
                                                               it misses batches until it reads again
                                                               (the others get them; it replays the gap)
    statetier_event_subscribers                     gauge      subscriptions open on the streams
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from statetier.protocol.classify import SKIP_REASONS
from statetier.protocol.errors import RejectedState
from statetier.tiers.base import TierStats

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)

# (metric, type, help, TierStats attribute): the per-tier families read at scrape time.
_TIER_FAMILIES = (
    ("statetier_tier_used_bytes", "gauge", "Bytes of live objects in the tier.", "bytes_used"),
    ("statetier_tier_capacity_bytes", "gauge", "Capacity of the tier in bytes.", "capacity"),
    ("statetier_tier_objects", "gauge", "Live objects in the tier.", "objects"),
    ("statetier_leases", "gauge", "Leases held on the tier's objects.", "leases"),
    ("statetier_inflight_transfers", "gauge", "Stores and loads in progress in the tier.", "inflight"),
    ("statetier_evictions_total", "counter", "Objects the tier evicted.", "evictions"),
    ("statetier_compactions_total", "counter", "Compaction passes run.", "compactions_run"),
    ("statetier_compactions_blocked_total", "counter", "Compactions skipped or delayed by a lease.", "compactions_blocked"),
    ("statetier_compaction_reclaimed_bytes_total", "counter", "Bytes reclaimed by compaction.", "bytes_reclaimed"),
)

# (metric, help, TierStats.extra key): per-tier counters only some tiers report.
_TIER_EXTRA_COUNTERS = (
    ("statetier_leases_expired_total", "Leases dropped at their deadline.", "leases_expired"),
    ("statetier_lease_violations_total", "Bytes moved or freed under a lease (must stay 0).", "lease_violations"),
)


def rejection_reasons() -> list[str]:
    """Every ``RejectedState`` reason (the bounded values of the ``reason`` label)."""
    found, todo = [], [RejectedState]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls is not RejectedState and cls.reason not in found:
            found.append(cls.reason)
    return sorted(found)


# (metric, help, daemon_stats key): daemon-wide gauges read at scrape time.
_DAEMON_GAUGES = (
    ("statetier_connections", "Open client connections.", "connections"),
    ("statetier_inflight_requests", "Requests being served.", "inflight_requests"),
    ("statetier_budget_in_use_bytes", "Byte budget taken by in-flight payloads.", "budget_bytes_in_use"),
    ("statetier_budget_capacity_bytes", "The byte budget.", "budget_bytes_limit"),
    ("statetier_budget_waiters", "Requests waiting for byte budget.", "budget_waiters"),
    ("statetier_client_leases", "Leases held by clients.", "leases"),
)


_PING = ("daemon", "none", "ping")  # the labels of an answered PING


class Metrics:
    """The daemon's metrics; methods are cheap and never raise on valid label values."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._operations = Counter(
            "statetier_operations_total", "Operations finished.", ["tier", "kind", "op"], registry=r
        )
        self._bytes = Counter("statetier_bytes_total", "Payload bytes moved.", ["tier", "kind", "op"], registry=r)
        self._op_seconds = Histogram(
            "statetier_operation_seconds", "Latency of one operation.", ["tier", "op"], buckets=LATENCY_BUCKETS, registry=r
        )
        self._hits = Counter("statetier_hits_total", "Loads served, by tier.", ["tier", "kind"], registry=r)
        self._misses = Counter("statetier_misses_total", "Loads no tier could serve.", ["kind"], registry=r)
        self._rejections = Counter(
            "statetier_rejections_total", "Objects refused on load or put.", ["reason"], registry=r
        )
        # Present at 0 from the start: Prometheus' increase() cannot see a counter's first
        # step from nothing to 1, so an alert on the very first rejection needs a 0 sample.
        for reason in rejection_reasons():
            self._rejections.labels(reason)
        self._skipped = Counter(
            "statetier_skipped_candidates_total", "Candidates a load by key or a lookup passed over.", ["reason"],
            registry=r)
        for reason in SKIP_REASONS:
            self._skipped.labels(reason)
        self._unpublished = Counter(
            "statetier_unpublished_puts_total", "Puts asked to publish with no cross-node tier.", registry=r)
        self._evicted = Counter(
            "statetier_evicted_objects_total", "Objects the engine evicted from a tier.", ["tier"], registry=r
        )
        self._demotions = Counter("statetier_demotions_total", "Objects demoted.", ["src", "dst"], registry=r)
        self._promotions = Counter("statetier_promotions_total", "Objects promoted.", ["src", "dst"], registry=r)
        self._busy = Counter("statetier_busy_total", "Requests answered Busy.", registry=r)
        self._errors = Counter("statetier_errors_total", "Requests that ended in an error.", ["reason"], registry=r)
        self._auth_failures = Counter(
            "statetier_auth_failures_total", "Connections refused at HELLO.", ["reason"], registry=r
        )
        self._lookup_seconds = Histogram(
            "statetier_lookup_seconds", "Latency of a joint-hit lookup.", buckets=LATENCY_BUCKETS, registry=r
        )
        self._lookup_tokens = Histogram(
            "statetier_lookup_hit_tokens", "Tokens a lookup could restore.", buckets=TOKEN_BUCKETS, registry=r
        )
        self._scrape_view = _ScrapeTimeCollector()
        r.register(self._scrape_view)
        self._op_children: dict[tuple[str, str, str], tuple] = {}
        self._hit_children: dict[tuple[str, str], Counter] = {}

    def observe_op(self, tier: str, kind: str, op: str, nbytes: int, seconds: float) -> None:
        self.observe_ops(tier, kind, op, 1, nbytes, seconds)

    def observe_ops(self, tier: str, kind: str, op: str, count: int, nbytes: int, seconds: float) -> None:
        """``count`` operations of one batch, ``nbytes`` in all, each taking ``seconds``."""
        # every request lands here: labels() costs µs per call, so each label set's children
        # are looked up once (label values are bounded, and so is this cache)
        children = self._op_children.get((tier, kind, op))
        if children is None:
            children = self._op_children[(tier, kind, op)] = (
                self._operations.labels(tier, kind, op), self._bytes.labels(tier, kind, op),
                self._op_seconds.labels(tier, op))
        operations, moved, latency = children
        operations.inc(count)
        moved.inc(nbytes)
        for _ in range(count):
            latency.observe(seconds)

    def count_ping(self) -> None:
        """A PING answered from the connection's callback: counted, not timed (it takes no time
        the daemon could report)."""
        child = self._op_children.get(_PING)
        if child is None:
            self.observe_ops(*_PING, 1, 0, 0.0)
        else:
            child[0].inc()

    def count_hit(self, tier: str, kind: str) -> None:
        child = self._hit_children.get((tier, kind))
        if child is None:
            child = self._hit_children[(tier, kind)] = self._hits.labels(tier, kind)
        child.inc()

    def count_miss(self, kind: str) -> None:
        self._misses.labels(kind).inc()

    def count_rejection(self, reason: str) -> None:
        self._rejections.labels(reason).inc()

    def count_skipped_candidate(self, reason: str) -> None:
        self._skipped.labels(reason).inc()

    def count_unpublished(self) -> None:
        self._unpublished.inc()

    def count_eviction(self, tier: str, n: int = 1) -> None:
        self._evicted.labels(tier).inc(n)

    def count_demotion(self, src: str, dst: str, n: int = 1) -> None:
        self._demotions.labels(src, dst).inc(n)

    def count_promotion(self, src: str, dst: str) -> None:
        self._promotions.labels(src, dst).inc()

    def count_busy(self) -> None:
        self._busy.inc()

    def count_error(self, reason: str) -> None:
        self._errors.labels(reason).inc()

    def count_auth_failure(self, reason: str) -> None:
        self._auth_failures.labels(reason).inc()

    def observe_lookup(self, tokens: int, seconds: float) -> None:
        self._lookup_tokens.observe(tokens)
        self._lookup_seconds.observe(seconds)

    def set_redis_available(self, up: bool) -> None:
        self._scrape_view.redis_up = bool(up)

    def track_events(self, event_stats: Callable[[], dict]) -> None:
        """Read the KV event publisher's ``stats()`` at every scrape (``daemon.events``)."""
        self._scrape_view.event_stats = event_stats

    def track(self, tier_stats: Callable[[], list[TierStats]], daemon_stats: Callable[[], dict]) -> None:
        """Read ``tier_stats()`` and ``daemon_stats()`` at every scrape (replaces earlier ones)."""
        self._scrape_view.tier_stats = tier_stats
        self._scrape_view.daemon_stats = daemon_stats


class _ScrapeTimeCollector(Collector):
    """Gauges and tier counters taken from live stats when Prometheus scrapes.

    Scrapes run on the event loop (``daemon/http.py``), so the stats callables see a
    consistent state without locks. A callable that raises costs its families for that
    scrape only, and is counted.
    """

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
        yield from self._daemon_gauges()
        yield from self._event_families()
        if self.redis_up is not None:
            yield GaugeMetricFamily("statetier_redis_up", "1 when the Redis tier answered, else 0.", value=int(self.redis_up))
        yield CounterMetricFamily(
            "statetier_scrape_errors_total", "Scrapes where a stats callable raised.", value=self.scrape_errors
        )

    def _tier_families(self) -> Iterator[Metric]:
        stats = self._try_read(self.tier_stats, "tier_stats", list)
        if stats is None:
            return
        for name, kind, doc, attr in _TIER_FAMILIES:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(name, doc, labels=["tier"])
            for tier in stats:
                family.add_metric([tier.tier], getattr(tier, attr))
            yield family
        for name, doc, key in _TIER_EXTRA_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier in stats:
                value = tier.extra.get(key)
                if _is_number(value):
                    family.add_metric([tier.tier], value)
            yield family

    def _daemon_gauges(self) -> Iterator[Metric]:
        stats = self._try_read(self.daemon_stats, "daemon_stats", dict)
        if stats is None:
            return
        for name, doc, key in _DAEMON_GAUGES:
            value = stats.get(key)
            if _is_number(value):
                yield GaugeMetricFamily(name, doc, value=value)

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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
