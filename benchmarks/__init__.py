"""The benchmarks: every figure a ratio to a raw limit measured in the same run.

``statetier bench`` (``cli.py``) runs the suites; ``python -m statetier.benchmarks.report``
runs the serving workloads and writes docs/benchmarks.md with its plots.

- ``cli`` — ``statetier bench``: suites ``seal``, ``tiers``, ``sdk``, ``workloads``; the summary table.
- ``rows``, ``machine`` — the row every benchmark writes; the machine and its load.
- ``seal`` — sealing / opening against copy + BLAKE3. ``tiers`` — each tier's store / load
  against its medium (memcpy, pwrite+fdatasync, preadv, redis-py SET/GET).
- ``sdk``, ``procs`` — the same-host hot path through the SDK (with per-phase timings),
  its own daemon and a raw echo server.
- ``workloads`` — serving workloads: ``workload_pd`` (PD handoff of a whole request through
  Redis), ``workload_prefix`` (multi-turn prefix reuse), ``workload_clients`` (concurrent
  workers), ``workload_sglang`` (the SGLang backend); ``workload_models`` (real geometries),
  ``workload_raw`` (their raw limits).
- ``report``, ``report_markdown``, ``report_plots``, ``report_recompute`` — docs/benchmarks.md.
"""
