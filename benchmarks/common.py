"""What the benchmark scripts share, so that their JSON reads alike (``statetier bench``).

- ``result(suite, tier, op, size_bytes, batch, gbps, raw, raw_gbps, p50_us, p99_us, **extra)``
  — one row of ``results``; ``ratio`` is derived as ``gbps / raw_gbps``. Latency rows give
  bytes per p50 time, so their ratio is raw p50 / p50. Extra fields: ``target``,
  ``metric`` (``throughput`` | ``latency``), ``raw_p50_us`` …
- ``RESULT_FIELDS`` — the fields every row has; ``percentile(samples, q)`` — nearest rank.
- ``machine_info()`` — CPU model, cores, memory, kernel, Python, torch and library versions,
  git commit; callers add ``load_average_before`` / ``load_average_after``.
- ``write_json(path, rows, machine, **extra)`` — ``{"results": rows, "machine": machine, …}``.
- ``seal_rows(data)`` / ``tier_rows(data)`` — the JSON of ``seal.py`` / ``tiers.py`` as rows.

They live in the package (``statetier.daemon.bench``) because ``statetier bench`` must
run installed, where this folder does not exist; this module is their name here.
"""

from statetier.daemon.bench import (
    RESULT_FIELDS,
    machine_info,
    percentile,
    result,
    seal_rows,
    tier_rows,
    write_json,
)

__all__ = ["RESULT_FIELDS", "machine_info", "percentile", "result", "seal_rows", "tier_rows", "write_json"]
