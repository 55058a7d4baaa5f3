"""The connector's counts inside vLLM: its ``KVConnectorStats`` and Prometheus metrics.

``metric_classes()`` → ``{"StatetierConnectorStats": …, "StatetierPromMetrics": …}``, built
once (vLLM imported) on first call, and named under the package like the connector:

- ``StatetierConnectorStats(data)`` — ``data`` is the flat counters of ``stats.ConnectorCounts``
  (both sides send theirs each step: ``get_kv_connector_stats``); ``aggregate`` sums them,
  ``reduce`` gives vLLM's log line (hits, misses, refusals, deadline misses, MB and seconds
  per direction).
- ``StatetierPromMetrics`` — counters under vLLM's labels (model, engine) plus one bounded
  label each: ``vllm:statetier_lookups_total``, ``vllm:statetier_hits_total``,
  ``vllm:statetier_hit_tokens_total``, ``vllm:statetier_misses_total{reason}``,
  ``vllm:statetier_refusals_total{reason}``, ``vllm:statetier_deadline_misses_total{op}``,
  ``vllm:statetier_transfer_bytes_total{direction}``,
  ``vllm:statetier_transfer_seconds_total{direction}``,
  ``vllm:statetier_transfer_objects_total{direction}``, ``vllm:statetier_saves_lost_total{reason}``,
  ``vllm:statetier_saves_unkeyed_total{field}``, ``vllm:statetier_handoffs_total{how}``,
  ``vllm:statetier_scheduler_calls_total{call}``, ``vllm:statetier_scheduler_seconds_total{call}``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .stats import merge

_built: dict[str, type] = {}

#: counter name → (metric, documentation, the label its suffix fills or None)
METRICS = {
    "lookups": ("lookups", "Requests the connector asked the daemon (or a handoff) about.", None),
    "hits": ("hits", "Requests with state to restore.", None),
    "hit_tokens": ("hit_tokens", "Prompt tokens offered for restore.", None),
    "misses": ("misses", "Requests without state to restore, by reason.", "reason"),
    "refusals": ("refusals", "Loads refused or failed (the request recomputed), by reason.", "reason"),
    "deadline_misses": ("deadline_misses", "Daemon calls not answered within the deadline, by operation.", "op"),
    "bytes": ("transfer_bytes", "Bytes loaded into and saved from vLLM's blocks, by direction.", "direction"),
    "seconds": ("transfer_seconds", "Seconds from start to end of the transfers, by direction.", "direction"),
    "objects": ("transfer_objects", "Objects loaded and saved, by direction.", "direction"),
    "saves_failed": ("saves_lost", "Saves lost (a later miss), by reason.", "reason"),
    "saves_skipped": ("saves_lost", "Saves lost (a later miss), by reason.", "reason"),
    "saves_unkeyed": ("saves_unkeyed", "Requests not saved: what vLLM keys them by cannot be keyed, by field.",
                      "field"),
    "handoffs": ("handoffs", "Handoffs built by ref or by key (producer), or looked up instead (consumer).", "how"),
    "calls": ("scheduler_calls", "vLLM scheduler-thread calls the connector times, by call.", "call"),
    "scheduler_seconds": ("scheduler_seconds", "Seconds vLLM's scheduler thread spent in those calls, by call.",
                          "call"),
}


def metric_classes() -> dict[str, type]:
    if not _built:
        _built.update(_build())
    return _built


def summary(data: dict[str, float]) -> dict[str, int | float]:
    """vLLM's log line: counts, MB and seconds (rounded)."""
    out: dict[str, int | float] = {}
    for name, value in sorted(data.items()):
        if name.startswith("bytes."):
            out[f"mb_{name[6:]}"] = round(value / 1e6, 3)
        elif name.startswith("seconds."):
            out[f"s_{name[8:]}"] = round(value, 3)
        else:
            out[name.replace(".", "_")] = int(value)
    return out


def _build() -> dict[str, type]:
    # vLLM's classes, looked up at run time (vLLM is optional): Any to the checker
    base: Any = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics")

    class StatetierConnectorStats(base.KVConnectorStats):
        def reset(self) -> None:
            self.data: dict[str, float] = {}

        def is_empty(self) -> bool:
            return not self.data

        def aggregate(self, other):
            if other is not None and not other.is_empty():
                self.data = merge(self.data, other.data)
            return self

        def reduce(self) -> dict[str, int | float]:
            return summary(self.data)

    class StatetierPromMetrics(base.KVConnectorPromMetrics):
        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._families: dict[str, Any] = {}
            for metric, documentation, label in METRICS.values():
                if metric not in self._families:
                    self._families[metric] = self._counter_cls(
                        name=f"vllm:statetier_{metric}_total", documentation=documentation,
                        labelnames=labelnames + ([label] if label else []))

        def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
            for name, value in (transfer_stats_data or {}).items():
                counter, _, suffix = name.partition(".")
                if counter not in METRICS or value <= 0:
                    continue
                metric, _, label = METRICS[counter]
                if counter in ("saves_failed", "saves_skipped"):
                    suffix = counter[len("saves_"):]
                values = list(self.per_engine_labelvalues[engine_idx]) + ([suffix] if label else [])
                self._families[metric].labels(*values).inc(value)

    built: dict[str, type] = {"StatetierConnectorStats": StatetierConnectorStats,
                              "StatetierPromMetrics": StatetierPromMetrics}
    for name, cls in built.items():
        cls.__qualname__, cls.__module__ = name, __package__
    return built
