"""The rows every benchmark writes, so that their JSON reads alike (``statetier bench``).

- ``result(suite, tier, op, size_bytes, batch, gbps, raw, raw_gbps, p50_us, p99_us, **extra)``
  — one row; ``ratio`` is derived as ``gbps / raw_gbps`` (≥ 1 is faster than the raw limit);
  latency rows express a round trip as bytes per p50 time, so their ratio is raw p50 / p50.
  Extra fields: ``target`` (the ratio aimed at), ``metric`` (``throughput`` | ``latency``) …
- ``RESULT_FIELDS`` — the fields every row has; ``percentile(samples, q)`` — nearest rank.
- ``seal_rows(data)`` / ``tier_rows(data)`` — the JSON of ``seal.py`` / ``tiers.py`` as rows.
- ``write_json(path, rows, machine, **extra)`` — ``{"results": rows, "machine": machine, …}``.
- ``KiB``, ``MiB``.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def seal_rows(data: dict) -> list[dict]:
    """``seal.py --json`` rows as result rows: one ``seal`` and one ``open`` each."""
    rows = []
    for item in data.get("results") or []:
        size = item["payload_bytes"]
        for op in ("seal", "open"):
            gbps = item[f"{op}_gbps"]
            rows.append(result("seal", "memory", op, size, 1, gbps, item["digest"], item["raw_gbps"],
                               size / gbps / 1e3 if gbps else None, None, target=0.9, metric="throughput",
                               ratio_paired=item.get(f"{op}_ratio"), case=item.get("case"),
                               tensors=item.get("tensors"), copy_gbps=item.get("copy_gbps"),
                               overhead_us=item.get(f"{op}_overhead_us")))
    return rows


def tier_rows(data: dict) -> list[dict]:
    """``tiers.py --json`` rows, with ``ratio`` recomputed as ``gbps / raw_gbps``."""
    rows = []
    for item in data.get("rows") or data.get("results") or []:
        extra = {k: v for k, v in item.items() if k not in RESULT_FIELDS}
        extra.setdefault("metric", "throughput")
        extra["ratio_paired"] = item.get("ratio")
        rows.append(result(item.get("suite", "tiers"), item["tier"], item["op"], item["size_bytes"],
                           item.get("batch", 1), item.get("gbps"), item.get("raw", ""), item.get("raw_gbps"),
                           item.get("p50_us"), item.get("p99_us"), **extra))
    return rows




def write_json(path: str | Path, rows: list[dict], machine: dict, **extra) -> None:
    """The one JSON object other tools read: ``{"results": rows, "machine": machine, **extra}``."""
    with open(path, "w") as handle:
        json.dump({"results": rows, "machine": machine, **extra}, handle, indent=2, default=str)
