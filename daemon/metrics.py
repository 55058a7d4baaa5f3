"""Every Prometheus metric of the daemon, declared once, against an injected registry.

``Metrics(registry=None)`` (None → a fresh ``CollectorRegistry``, never the global one).
The engine and the server call the ``observe_*``/``count_*``/``set_*`` methods; the app
calls ``track(tier_stats, daemon_stats)`` once so gauges are read at scrape time
(``daemon.metrics_scrape``). ``NullMetrics()`` has the same methods and counts nothing:
what an engine built without metrics holds (tests, embedded use), so no caller checks
for None. Labels are bounded: ``tier`` (device, host, disk, redis),
``kind`` (kv, ssm), ``op``, ``reason`` (an error class's ``.reason``), ``src``/``dst``
(tier names), ``tenant`` (configured tenants). Never a key or id.

Counted by the daemon as things happen:

    statetier_operations_total{tier,kind,op}        counter    operations finished (put, load, …)
    statetier_bytes_total{tier,kind,op}             counter    payload bytes those operations moved
    statetier_operation_seconds{tier,kind,op}       histogram  latency of one operation
    statetier_hits_total{tier,kind}                 counter    loads that served bytes, by the tier that had
                                                               them (a refused load is no hit)
    statetier_misses_total{kind}                    counter    loads no tier could serve (kv, ssm at 0)
    statetier_lookup_requested_tokens_total         counter    tokens lookups asked for (the last boundary)
    statetier_lookup_restored_tokens_total          counter    tokens they could restore (the joint hit):
                                                               the token hit ratio is restored / requested
    statetier_rejections_total{reason}              counter    objects refused on load/put (DESIGN §4);
                                                               every RejectedState reason starts at 0
    statetier_skipped_candidates_total{reason}      counter    candidates a load by key or a lookup passed over:
                                                               speculative, stale, damaged, unknown_key, misfiled
                                                               (all at 0)
    statetier_unpublished_puts_total                counter    puts that asked to publish, stored here only (no
                                                               Redis tier, redis.publish_without_redis = "local")
    statetier_outage_served_total{op}               counter    loads, puts and lookups served while the shared
                                                               registry (Redis) was unreachable (op: load, put,
                                                               lookup; all at 0)
    statetier_demotions_total{src,dst}              counter    objects moved to a slower tier
    statetier_promotions_total{src,dst}             counter    objects copied to a faster tier
    statetier_purged_objects_total{tier}            counter    copies removed by a purge
    statetier_busy_total                            counter    requests answered Busy (byte budget)
    statetier_errors_total{reason}                  counter    requests that ended in an error
    statetier_auth_failures_total{reason}           counter    connections refused at HELLO
    statetier_lookup_seconds                        histogram  latency of a joint-hit lookup
    statetier_lookup_hit_tokens                     histogram  tokens a lookup could restore (0 = miss)
    statetier_build_info{version,format,protocols}  gauge      1: the release, sealed-object format, frame protocols
    statetier_payload_pass_bytes_total{op}          counter    payload bytes this process copied or hashed (op:
                                                               copied, hashed; ``protocol.passes``, read at scrape)
    process_*                                       the process collector (CPU seconds, resident memory, fds,
                                                    start time)

Read at scrape time: the families of ``daemon.metrics_scrape`` (tier usage and counters,
recovery, checkpoints, dead segment bytes, daemon gauges, write-behind backlog, tenant usage
and quotas, the KV event streams once ``track_events`` is called, ``statetier_redis_up``,
``statetier_scrape_errors_total``), among them the peer tier's:

    statetier_peer_faults_total{reason}             counter    faults between daemons (``tiers.peer.faults``:
                                                               redialled, retried, suspected, fenced_gone,
                                                               fenced_refused, fenced_replaced, unfenced,
                                                               reannounced, renewal_failed; all at 0)
    statetier_peer_owners_fenced{tier}              gauge      owners whose entries this daemon no longer offers

``counted(metrics)`` → the counted families an operator acts on, as plain numbers (what STATS
carries as ``counters`` and ``statetier stats`` prints): hits by tier and kind, misses and
rejections, skipped candidates, outage-served requests, busy answers, errors by reason, the
lookups' tokens; ``{}`` for ``NullMetrics``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from statetier.protocol.classify import SKIP_REASONS
from statetier.protocol.errors import RejectedState
from statetier.protocol.frames import PROTOCOL_VERSIONS
from statetier.protocol.identity import Kind
from statetier.protocol.passes import PASSES
from statetier.protocol.sealed_format import FORMAT_VERSION
from statetier.tiers.base import TierStats

from .metrics_scrape import ScrapeTimeCollector

LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


def rejection_reasons() -> list[str]:
    """Every ``RejectedState`` reason (the bounded values of the ``reason`` label)."""
    found, todo = [], [RejectedState]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls is not RejectedState and cls.reason not in found:
            found.append(cls.reason)
    return sorted(found)


_PING = ("daemon", "none", "ping")  # the labels of an answered PING


class Metrics:
    """The daemon's metrics; methods are cheap and never raise on valid label values."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._serving_metrics(r)
        self._refusal_metrics(r)
        self._movement_metrics(r)
        self._scrape_view = ScrapeTimeCollector()
        r.register(self._scrape_view)
        r.register(_PassesCollector())
        build = Gauge("statetier_build_info", "The running release: version, sealed-object format, frame protocols.",
                      ["version", "format", "protocols"], registry=r)
        build.labels(_version(), str(FORMAT_VERSION), ",".join(map(str, PROTOCOL_VERSIONS))).set(1)
        ProcessCollector(registry=r)
        self._op_children: dict[tuple[str, str, str], tuple] = {}
        self._hit_children: dict[tuple[str, str], Counter] = {}

    def _serving_metrics(self, r: CollectorRegistry) -> None:
        """Operations, bytes, latencies, hits and misses, lookups."""
        self._operations = Counter(
            "statetier_operations_total", "Operations finished.", ["tier", "kind", "op"], registry=r
        )
        self._bytes = Counter("statetier_bytes_total", "Payload bytes moved.", ["tier", "kind", "op"], registry=r)
        self._op_seconds = Histogram(
            "statetier_operation_seconds", "Latency of one operation.", ["tier", "kind", "op"], buckets=LATENCY_BUCKETS,
            registry=r)
        self._hits = Counter("statetier_hits_total", "Loads that served bytes, by the tier that had them.",
                             ["tier", "kind"], registry=r)
        self._misses = Counter("statetier_misses_total", "Loads no tier could serve.", ["kind"], registry=r)
        for kind in Kind:  # at 0 from the start, as rejections: a hit ratio needs both sides
            self._misses.labels(kind.name.lower())
        self._requested_tokens = Counter(
            "statetier_lookup_requested_tokens_total", "Tokens lookups asked for (their last boundary).", registry=r)
        self._restored_tokens = Counter(
            "statetier_lookup_restored_tokens_total", "Tokens lookups could restore (the joint hit).", registry=r)
        self._lookup_seconds = Histogram(
            "statetier_lookup_seconds", "Latency of a joint-hit lookup.", buckets=LATENCY_BUCKETS, registry=r
        )
        self._lookup_tokens = Histogram(
            "statetier_lookup_hit_tokens", "Tokens a lookup could restore.", buckets=TOKEN_BUCKETS, registry=r
        )

    def _refusal_metrics(self, r: CollectorRegistry) -> None:
        """Rejections, skipped candidates, requests served or refused apart from the rule."""
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
            "statetier_unpublished_puts_total", "Puts that asked to publish, stored here only (no Redis tier; "
            "redis.publish_without_redis = \"local\").", registry=r)
        self._outage_served = Counter(
            "statetier_outage_served_total", "Requests served while the shared registry (Redis) was unreachable, "
            "from this daemon's own copies and versions.", ["op"], registry=r)
        for op in ("load", "put", "lookup"):
            self._outage_served.labels(op)
        self._busy = Counter("statetier_busy_total", "Requests answered Busy.", registry=r)
        self._errors = Counter("statetier_errors_total", "Requests that ended in an error.", ["reason"], registry=r)
        self._auth_failures = Counter(
            "statetier_auth_failures_total", "Connections refused at HELLO.", ["reason"], registry=r
        )

    def _movement_metrics(self, r: CollectorRegistry) -> None:
        """Copies moved between tiers, and removed by purges."""
        self._demotions = Counter("statetier_demotions_total", "Objects demoted.", ["src", "dst"], registry=r)
        self._promotions = Counter("statetier_promotions_total", "Objects promoted.", ["src", "dst"], registry=r)
        self._purged = Counter(
            "statetier_purged_objects_total", "Copies removed by a purge (statetier purge).", ["tier"], registry=r)

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
                self._op_seconds.labels(tier, kind, op))
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

    def count_outage_served(self, op: str, n: int = 1) -> None:
        if n:
            self._outage_served.labels(op).inc(n)

    def count_demotion(self, src: str, dst: str, n: int = 1) -> None:
        self._demotions.labels(src, dst).inc(n)

    def count_promotion(self, src: str, dst: str) -> None:
        self._promotions.labels(src, dst).inc()

    def count_purged(self, tier: str, n: int) -> None:
        self._purged.labels(tier).inc(n)

    def count_busy(self) -> None:
        self._busy.inc()

    def count_error(self, reason: str) -> None:
        self._errors.labels(reason).inc()

    def count_auth_failure(self, reason: str) -> None:
        self._auth_failures.labels(reason).inc()

    def observe_lookup(self, tokens: int, seconds: float, requested: int | None = None) -> None:
        """One joint-hit lookup: ``tokens`` restorable of ``requested`` asked for."""
        self._lookup_tokens.observe(tokens)
        self._lookup_seconds.observe(seconds)
        self._restored_tokens.inc(tokens)
        self._requested_tokens.inc(tokens if requested is None else requested)

    def set_redis_available(self, up: bool) -> None:
        self._scrape_view.redis_up = bool(up)

    def track_events(self, event_stats: Callable[[], dict]) -> None:
        """Read the KV event publisher's ``stats()`` at every scrape (``daemon.events``)."""
        self._scrape_view.event_stats = event_stats

    def track(self, tier_stats: Callable[[], list[TierStats]], daemon_stats: Callable[[], dict]) -> None:
        """Read ``tier_stats()`` and ``daemon_stats()`` at every scrape (replaces earlier ones)."""
        self._scrape_view.tier_stats = tier_stats
        self._scrape_view.daemon_stats = daemon_stats


class NullMetrics:
    """``Metrics`` that count nothing (see the module docstring): every method of ``Metrics``,
    with its signature, doing nothing."""

    def observe_op(self, tier: str, kind: str, op: str, nbytes: int, seconds: float) -> None:
        pass

    def observe_ops(self, tier: str, kind: str, op: str, count: int, nbytes: int, seconds: float) -> None:
        pass

    def count_ping(self) -> None:
        pass

    def count_hit(self, tier: str, kind: str) -> None:
        pass

    def count_miss(self, kind: str) -> None:
        pass

    def count_rejection(self, reason: str) -> None:
        pass

    def count_skipped_candidate(self, reason: str) -> None:
        pass

    def count_unpublished(self) -> None:
        pass

    def count_outage_served(self, op: str, n: int = 1) -> None:
        pass

    def count_demotion(self, src: str, dst: str, n: int = 1) -> None:
        pass

    def count_promotion(self, src: str, dst: str) -> None:
        pass

    def count_purged(self, tier: str, n: int) -> None:
        pass

    def count_busy(self) -> None:
        pass

    def count_error(self, reason: str) -> None:
        pass

    def count_auth_failure(self, reason: str) -> None:
        pass

    def observe_lookup(self, tokens: int, seconds: float, requested: int | None = None) -> None:
        pass

    def set_redis_available(self, up: bool) -> None:
        pass

    def track_events(self, event_stats: Callable[[], dict]) -> None:
        pass

    def track(self, tier_stats: Callable[[], list[TierStats]], daemon_stats: Callable[[], dict]) -> None:
        pass


def counted(metrics: Metrics | NullMetrics) -> dict:
    """What ``metrics`` counted so far (see the module docstring), labels as nested keys; ``{}``
    for ``NullMetrics``."""
    if not isinstance(metrics, Metrics):
        return {}
    m = metrics  # the counters are this module's own
    hits: dict[str, dict[str, int]] = {}
    for (tier, kind), value in _counted(m._hits):
        hits.setdefault(tier, {})[kind] = value
    return {
        "hits": hits,
        "misses": {kind: value for (kind,), value in _counted(m._misses)},
        "rejections": {reason: value for (reason,), value in _counted(m._rejections)},
        "skipped_candidates": {reason: value for (reason,), value in _counted(m._skipped)},
        "outage_served": {op: value for (op,), value in _counted(m._outage_served)},
        "unpublished_puts": _total(m._unpublished),
        "busy": _total(m._busy),
        "errors": {reason: value for (reason,), value in _counted(m._errors)},
        "lookup_tokens": {"requested": _total(m._requested_tokens),
                          "restored": _total(m._restored_tokens)},
    }


def _counted(counter: Counter) -> list[tuple[tuple[str, ...], int]]:
    """Each label set of ``counter`` with its count so far (those created, at 0 included)."""
    found = []
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                found.append((tuple(sample.labels.values()), int(sample.value)))  # in label order
    return found


def _total(counter: Counter) -> int:
    return sum(value for _, value in _counted(counter))


def _version() -> str:
    from statetier import __version__

    return __version__


class _PassesCollector(Collector):
    """``statetier_payload_pass_bytes_total{op}``: what ``protocol.passes`` counted so far."""

    def collect(self):
        counted = PASSES.snapshot()
        family = CounterMetricFamily("statetier_payload_pass_bytes", "Payload bytes this process copied or hashed.",
                                     labels=["op"])
        family.add_metric(["copied"], counted.copied)
        family.add_metric(["hashed"], counted.hashed)
        yield family
