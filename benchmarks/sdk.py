"""The end-to-end SDK benchmark: puts, loads and lookups through ``statetier.clients``.

Usage: ``python benchmarks/sdk.py [--quick] [--json FILE] [--url URL] [--dir DIR]``

Without ``--url`` it starts its own ``statetier serve`` (host tier only) in a subprocess;
with it, it measures the daemon already running there (in a namespace of its own, deleting
what it stored). For 64 KiB, 2 MiB and 32 MiB KV pages it times put and load by
``StateRef`` through shared memory and inline, one and eight objects in flight, each next
to a copy + keyed BLAKE3 of the same bytes timed in the same repetition (target ≥ 0.7);
and the p50/p99 round trip of a small ``lookup`` (and of ``ping``) next to a raw uvloop
round trip over a Unix socket (target: p50 at most 3× raw). The JSON is the one
``statetier bench --json`` writes (``{"results": [...], "machine": {...}}``).

The suite lives in the package, ``statetier.daemon.bench_sdk``, so that an installed
statetier (which has no ``benchmarks/``) runs it too as ``statetier bench sdk``; this
script is its entry point in a checkout. Other scripts import the building blocks from
here: ``run_sdk``, ``SdkPlan``, ``QUICK``, ``FULL``, ``own_daemon``, ``echo_server``, ``Payloads``.
"""

from __future__ import annotations

import sys

from statetier.daemon.bench import main as bench_main
from statetier.daemon.bench_procs import echo_server, own_daemon
from statetier.daemon.bench_sdk import FULL, QUICK, Payloads, SdkPlan, run_sdk

__all__ = ["FULL", "QUICK", "Payloads", "SdkPlan", "echo_server", "main", "own_daemon", "run_sdk"]


def main(argv: list[str] | None = None) -> int:
    return bench_main([*(sys.argv[1:] if argv is None else argv), "sdk"])


if __name__ == "__main__":
    sys.exit(main())
