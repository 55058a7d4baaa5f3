"""The rows every benchmark writes, shared by ``statetier bench`` (``daemon.bench``) and its
``sdk`` suite (``daemon.bench_sdk``), so that neither imports the other at module level.

- ``result(suite, tier, op, size_bytes, batch, gbps, raw, raw_gbps, p50_us, p99_us, **extra)``
  — one row; ``ratio`` is derived as ``gbps / raw_gbps``.
- ``RESULT_FIELDS`` — the fields every row has; ``percentile(samples, q)`` — nearest rank.
- ``KiB``, ``MiB``.
"""

from __future__ import annotations

RESULT_FIELDS = ("suite", "tier", "op", "size_bytes", "batch", "gbps", "raw", "raw_gbps", "ratio", "p50_us", "p99_us")
KiB, MiB = 1024, 1024 * 1024


def result(suite: str, tier: str, op: str, size_bytes: int, batch: int, gbps: float | None, raw: str,
           raw_gbps: float | None, p50_us: float | None, p99_us: float | None, **extra) -> dict:
    """One result row; ``ratio`` is derived here so that it is ``gbps / raw_gbps`` exactly."""
    ratio = gbps / raw_gbps if gbps is not None and raw_gbps else None
    row = {"suite": suite, "tier": tier, "op": op, "size_bytes": int(size_bytes), "batch": int(batch),
           "gbps": gbps, "raw": raw, "raw_gbps": raw_gbps, "ratio": ratio, "p50_us": p50_us, "p99_us": p99_us}
    row.update(extra)
    return row


def percentile(samples, q: float) -> float:
    """The ``q``-th percentile (0–100) by nearest rank of the sorted samples."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]
