"""``statetier bench``: every benchmark of one run, as ratios to raw limits of the same run.

- ``main(argv) -> int`` — what ``statetier bench`` calls (``daemon/cli/serve.py``, a lazy import):
  options ``--url``, ``--quick``, ``--json FILE``, ``--dir DIR`` (temp files) and suite
  names to run only those (``seal``, ``tiers``, ``sdk``, ``workloads``; default all but
  ``workloads``): ``statetier bench --quick sdk``; ``--only PART …``, ``--peer-transport
  tcp|nixl`` and ``--peer-encrypt`` are passed on to ``workloads`` (``statetier bench
  workloads --only peers --peer-transport nixl``; ``--only peers --peer-encrypt``).
- ``workloads`` (``workloads.py``: PD handoff, multi-turn prefix reuse, concurrent clients;
  minutes in full) runs only when named; ``report.py`` runs it.
- Suites: ``seal``, ``tiers`` and ``workloads`` are the modules ``seal.py``, ``tiers.py`` and
  ``workloads.py`` of this package, run as subprocesses (``python -m
  statetier.benchmarks.seal``; they print their own tables); ``sdk`` (``sdk.py``) runs in
  this process. Rows are ``rows.result`` rows (``ratio`` = ``gbps / raw_gbps``).

``--json FILE`` writes ``{"results", "machine", "suites", "options", "seconds"}``. The
suites' own ratios (medians of per-repetition ratios) are kept as ``ratio_paired``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .machine import machine_info
from .rows import KiB, MiB, seal_rows, tier_rows, write_json

SUITES = ("seal", "tiers", "sdk", "workloads")
SUITE_HELP = {
    "seal": "sealing and opening objects against copy + BLAKE3 of the same bytes (seconds)",
    "tiers": "each tier's store and load against its medium: memcpy, pwrite+fdatasync, preadv, redis-py (a minute)",
    "sdk": "put and load through statetier.clients and a daemon, against a raw echo server (a minute)",
    "workloads": "serving workloads: PD handoff, multi-turn prefix reuse, concurrent clients (minutes; only "
                 "when named; its own options: python -m statetier.benchmarks.workloads --help)",
}
DEFAULT_SUITES = ("seal", "tiers", "sdk")
MODULE_SUITES = ("seal", "tiers", "workloads")  # run as ``python -m statetier.benchmarks.<name>``



# ---------------------------------------------------------------------------- suites


def run_module_suite(name: str, quick: bool, workdir: Path, tmp_dir: str | None,
                     options: list[str] | None = None) -> dict:
    """Run ``statetier.benchmarks.<name>`` in a subprocess (``options`` passed on); its table
    goes to our stdout."""
    out = workdir / f"{name}.json"
    command = [sys.executable, "-m", f"statetier.benchmarks.{name}", "--json", str(out)]
    command += ["--quick"] if quick else []
    command += options or []
    if name in ("tiers", "workloads") and tmp_dir:
        command += ["--dir", tmp_dir]
    print(f"\n== {name}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    try:
        returncode = subprocess.run(command, timeout=600 if quick else 1800).returncode
    except subprocess.TimeoutExpired:
        returncode = -1
    seconds = time.perf_counter() - started
    if returncode != 0 or not out.is_file():
        print(f"== {name}: FAILED (exit status {returncode})", flush=True)
        return {"status": "failed", "module": name, "returncode": returncode, "seconds": seconds, "rows": []}
    data = json.loads(out.read_text())
    rows = seal_rows(data) if name == "seal" else tier_rows(data)
    return {"status": "ok", "module": name, "seconds": seconds, "rows": rows,
            "machine": data.get("machine"), "load_average_after": data.get("load_average_after")}


def run_sdk_suite(url: str | None, quick: bool, tmp_dir: str | None) -> dict:
    from .sdk import FULL, QUICK, run_sdk  # lazy: torch and the client

    print(f"\n== sdk: end-to-end through statetier.clients ({'daemon at ' + url if url else 'own daemon'})",
          flush=True)
    print(HEAD, flush=True)
    started = time.perf_counter()
    try:
        rows, details = run_sdk(url, QUICK if quick else FULL, tmp_dir=tmp_dir, report=print_row)
    except Exception as exc:  # the other suites' results still count; the exit status says it failed
        print(f"== sdk: FAILED — {type(exc).__name__}: {exc}", flush=True)
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "rows": [],
                "seconds": time.perf_counter() - started}
    return {"status": "ok", "seconds": time.perf_counter() - started, "rows": rows, **details}


# ---------------------------------------------------------------------------- output


def _size(n: int) -> str:
    if n >= MiB:
        return f"{n / MiB:.2f}M"
    return f"{n / KiB:.1f}K" if n >= KiB else f"{n}B"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


HEAD = (f"{'suite':<6} {'tier':<13} {'op':<9} {'size':>7} {'bat':>3} {'GB/s':>7} {'raw':<15} {'raw GB/s':>8}"
        f" {'ratio':>6} {'target':>7} {'p50 µs':>9} {'p99 µs':>9}")


def format_row(row: dict) -> str:
    latency = row.get("metric") == "latency"
    target = row.get("target")
    mark = "" if target is None or row["ratio"] is None else ("" if row["ratio"] >= target else "*")
    raw = row["raw"] if not latency else f"{row['raw']} {_num(row.get('raw_p50_us'), '.0f')}µs"
    return (f"{row['suite']:<6} {row['tier']:<13} {row['op']:<9} {_size(row['size_bytes']):>7} {row['batch']:>3}"
            f" {'-' if latency else _num(row['gbps'], '.2f'):>7} {raw:<15}"
            f" {'-' if latency else _num(row['raw_gbps'], '.2f'):>8} {_num(row['ratio'], '.2f'):>6}"
            f" {'' if target is None else '≥' + format(target, '.2f'):>6}{mark:1}"
            f" {_num(row['p50_us'], '.0f'):>9} {_num(row['p99_us'], '.0f'):>9}"
            + (f"  2t {row['ratio_2t']:.2f}" if row.get("ratio_2t") is not None else ""))


def format_phases(row: dict) -> str | None:
    """The measured phases of one call of ``row`` (µs), in the order a call runs them."""
    phases = row.get("phases_us")
    if not phases:
        return None
    order = ["client_copy", "round_trip", "frames", "daemon", "daemon_per_item", "daemon_copy_and_seal", "daemon_seal",
             "daemon_open", "daemon_open_and_hash", "daemon_window_copy", "client_hash"]
    names = [n for n in order if n in phases] + sorted(set(phases) - set(order) - {"window_steps"})
    load = row.get("load_average")
    steps = phases.get("window_steps")
    return ("         phases µs: " + "  ".join(f"{n}={phases[n]:.0f}" for n in names)
            + (f"  (frames per call: {steps:.0f})" if steps is not None else "")
            + (f"  (load {load[0]:.2f})" if load else ""))


def format_passes(row: dict) -> str | None:
    """How many times each byte was copied (c) and hashed (h), per side, and on the raw paths."""
    passes = row.get("passes")
    if not passes:
        return None
    sides = [f"{op} {side} {c:.2f}c/{h:.2f}h" for op in ("put", "load") for side, (c, h) in passes.get(op, {}).items()]
    raw = [f"{name} {c:.0f}c/{h:.0f}h" for name, (c, h) in passes.get("raw", {}).items()]
    return "         passes per byte: " + ", ".join(sides) + "; raw: " + ", ".join(raw)


def print_row(row: dict) -> None:
    print(format_row(row), flush=True)
    for line in (format_phases(row), format_passes(row)):
        if line:
            print(line, flush=True)


def print_summary(rows: list[dict], suites: dict) -> None:
    print("\n== summary: ratio = GB/s ÷ raw GB/s of the same run (latency rows: raw p50 ÷ p50); * below target")
    print(HEAD)
    print("-" * len(HEAD))
    for row in rows:
        print_row(row)
    for name, info in suites.items():
        if info["status"] != "ok":
            print(f"{name}: {info['status'].upper()}")


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from statetier.daemon.client_env import DEFAULT_CLIENT_URL

    suites = "\n".join(f"  {name:<10} {text}" for name, text in SUITE_HELP.items())
    parser = argparse.ArgumentParser(
        prog="statetier bench", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"suites:\n{suites}\n\ne.g. statetier bench --quick sdk; default: {' '.join(DEFAULT_SUITES)}")
    parser.add_argument("--url", default=None,
                        help="benchmark the daemon already running there (default: start a private one)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about 40 s in all)")
    parser.add_argument("--json", metavar="FILE", help="also write the results and the machine as JSON")
    parser.add_argument("suite", nargs="*", metavar="SUITE",
                        help=f"run only these suites: {', '.join(SUITES)} (default: {', '.join(DEFAULT_SUITES)})")
    parser.add_argument("--dir", default=None, help="where temporary files go (default: the system temp dir)")
    parser.add_argument("--only", nargs="+", metavar="PART", default=None,
                        help="workloads: run only these parts (limits, pd, peers, prefix, prefix-peers, …)")
    parser.add_argument("--peer-transport", choices=("tcp", "nixl"), default=None,
                        help="workloads: the peers and prefix-peers parts with peers.transport = this")
    parser.add_argument("--peer-encrypt", action="store_true",
                        help="workloads: the peers and prefix-peers parts with peers.encrypt = true (AES-GCM)")
    parser.add_argument("--mooncake-python", metavar="PYTHON", default=None,
                        help="workloads: the peers rows beside Mooncake Store's TCP put and get, run by this Python "
                             "(a venv with mooncake-transfer-engine-non-cuda)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args([arg for arg in argv if arg != "--"])  # the CLI passes "--" through
    unknown = sorted(set(args.suite) - set(SUITES))
    if unknown:
        parser.error(f"unknown suite {unknown[0]!r}; suites are {', '.join(SUITES)}")
    if args.url == DEFAULT_CLIENT_URL:
        args.url = None  # the CLI's default address is not a request to benchmark a running daemon
    return args


def workload_options(args: argparse.Namespace) -> list[str]:
    """What ``workloads`` is passed of this command line."""
    return (["--only", *args.only] if args.only else []) + \
        (["--peer-transport", args.peer_transport] if args.peer_transport else []) + \
        (["--peer-encrypt"] if args.peer_encrypt else []) + \
        (["--mooncake-python", args.mooncake_python] if args.mooncake_python else [])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    suites_wanted = args.suite or list(DEFAULT_SUITES)
    before = machine_info()
    load_before = list(os.getloadavg())
    print(f"machine: {before['cpu_model']}, {before['cpus_usable']}/{before['cpus']} cpus, load "
          f"{', '.join(f'{x:.2f}' for x in load_before)}, kernel {before['kernel']}, python {before['python']}, "
          f"torch {before['torch']}, statetier {before['statetier']} ({before['git_commit'] or 'installed'})",
          flush=True)
    started = time.perf_counter()
    suites: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="statetier-bench-", dir=args.dir) as workdir:
        for name in suites_wanted:
            if name == "sdk":
                suites[name] = run_sdk_suite(args.url, args.quick, args.dir)
            else:
                suites[name] = run_module_suite(name, args.quick, Path(workdir), args.dir,
                                                workload_options(args) if name == "workloads" else None)
    rows = [row for name in suites_wanted for row in suites[name]["rows"]]
    seconds = time.perf_counter() - started
    print_summary(rows, suites)
    machine = {**before, "load_average_before": load_before, "load_average_after": list(os.getloadavg())}
    print(f"\n{seconds:.1f} s; load average after: {', '.join(f'{x:.2f}' for x in machine['load_average_after'])}")
    if args.json:
        write_json(args.json, rows, machine, seconds=seconds,
                   options={"quick": args.quick, "url": args.url, "suites": suites_wanted},
                   suites={name: {k: v for k, v in info.items() if k != "rows"} | {"rows": len(info["rows"])}
                           for name, info in suites.items()})
        print(f"wrote {args.json}")
    return 1 if any(info["status"] == "failed" for info in suites.values()) else 0
