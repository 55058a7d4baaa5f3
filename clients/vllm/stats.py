"""What the connector counts, as flat plain numbers both sides send vLLM each step.

``ConnectorCounts`` — a bag of named counters (``add(name, n)``, ``take()`` drains them into a dict,
``merge(a, b)`` sums two such dicts). Names, each with a bounded reason or direction:

- ``lookups``, ``hits``, ``hit_tokens`` (scheduler) — admissions asked, answered with a hit;
- ``misses.<reason>`` — ``none`` (nothing stored), ``deadline`` (no answer in time),
  ``unavailable`` (the daemon cannot be reached, or is suspect), ``error``, ``handoff``
  (a malformed handoff), ``handoff_<field>`` (a handoff of another ``cache_salt``, ``lora``,
  ``mm`` or ``prompt_embeds``), ``unkeyed_<field>`` (a request whose identity cannot be keyed);
- ``saves_unkeyed.<field>`` (scheduler) — requests not saved, for the same reason;
- ``handoffs.<how>`` — ``by_ref``, ``by_key`` (producer: the refs not all reported yet),
  ``looked_up`` (consumer: such a handoff, looked up instead);
- ``calls.<call>``, ``scheduler_seconds.<call>`` — ``request_finished`` on vLLM's scheduler
  thread: how often, how long (it makes no daemon call);
- ``refusals.<reason>`` (worker) — a load refused by the daemon or the client (the
  statetier reason: ``position``, ``stale``, ``fingerprint`` …, or ``trimmed``,
  ``unavailable``, ``deadline``), the request recomputed;
- ``deadline_misses.<op>`` — ``lookup``, ``handoff``, ``load``, ``save``, ``flush``;
- ``bytes.<load|save>``, ``seconds.<load|save>``, ``objects.<load|save>`` — transfers done;
- ``saves_failed``, ``saves_skipped`` — saves lost (a later miss, never an engine error).

The vLLM side (``connector.py``) wraps the dict in a ``KVConnectorStats`` and a Prometheus
view (``build_kv_connector_stats``, ``build_prom_metrics``).
"""

from __future__ import annotations

from typing import Mapping

from statetier.protocol.errors import ClientClosedError, StatetierError, Unavailable


class ConnectorCounts:
    def __init__(self) -> None:
        self._values: dict[str, float] = {}

    def add(self, name: str, n: float = 1) -> None:
        self._values[name] = self._values.get(name, 0) + n

    def get(self, name: str) -> float:
        return self._values.get(name, 0)

    def take(self) -> dict[str, float]:
        """Every counter since the last ``take``; then zero."""
        out, self._values = self._values, {}
        return out


def merge(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = dict(a)
    for name, value in b.items():
        out[name] = out.get(name, 0) + value
    return out


def reason_of(exc: BaseException) -> str:
    """The bounded label of a failure: a statetier error's reason, else its kind."""
    if isinstance(exc, (Unavailable, ClientClosedError, OSError)):
        return "unavailable"
    if isinstance(exc, StatetierError):
        return str(getattr(exc, "reason", "") or "error")
    return "error"
