"""``statetier bench``: every benchmark of one run, as ratios to raw limits of the same run.

- ``main(argv) -> int`` — what ``statetier bench`` calls (``daemon/cli.py``): options
  ``--url``, ``--quick``, ``--json FILE``, ``--dir DIR`` (temp files), ``--benchmarks DIR``
  (the checkout's ``benchmarks/``) and suite names to run only those (``seal``, ``tiers``,
  ``sdk``, ``workloads``; default all but ``workloads``): ``statetier bench --quick sdk``.
- ``workloads`` (``benchmarks/workloads.py``: PD handoff, multi-turn prefix reuse, concurrent
  clients; minutes in full) runs only when named; ``benchmarks/report.py`` runs it.
- Suites: ``seal`` and ``tiers`` are the scripts ``benchmarks/seal.py`` and
  ``benchmarks/tiers.py`` of a source checkout, run as subprocesses (they print their own
  tables); an installed package has no ``benchmarks/``, so they are reported ``missing``
  and the run goes on. ``sdk`` (``daemon/bench_sdk.py``) ships with the package.
- ``result(...)`` — one row of the JSON ``results`` list: ``suite, tier, op, size_bytes,
  batch, gbps, raw, raw_gbps, ratio, p50_us, p99_us`` plus extra fields. ``ratio`` is always
  ``gbps / raw_gbps`` (≥ 1 is faster than the raw limit); latency rows express a round trip
  as bytes per p50 time, so their ratio is raw p50 / p50. ``target`` is the ratio aimed at.
- ``machine_info()`` — CPU, cores, load average, kernel, Python, torch and library versions.

``--json FILE`` writes ``{"results", "machine", "suites", "options", "seconds"}``. The
suites' own ratios (medians of per-repetition ratios) are kept as ``ratio_paired``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from .bench_rows import RESULT_FIELDS, KiB, MiB, percentile, result

SUITES = ("seal", "tiers", "sdk", "workloads")
DEFAULT_SUITES = ("seal", "tiers", "sdk")
SCRIPT_SUITES = {"seal": "seal.py", "tiers": "tiers.py", "workloads": "workloads.py"}

__all__ = ["RESULT_FIELDS", "KiB", "MiB", "machine_info", "main", "percentile", "result", "seal_rows", "tier_rows",
           "write_json"]



def seal_rows(data: dict) -> list[dict]:
    """``benchmarks/seal.py --json`` rows as result rows: one ``seal`` and one ``open`` each."""
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
    """``benchmarks/tiers.py --json`` rows, with ``ratio`` recomputed as ``gbps / raw_gbps``."""
    rows = []
    for item in data.get("rows") or data.get("results") or []:
        extra = {k: v for k, v in item.items() if k not in RESULT_FIELDS}
        extra.setdefault("metric", "throughput")
        extra["ratio_paired"] = item.get("ratio")
        rows.append(result(item.get("suite", "tiers"), item["tier"], item["op"], item["size_bytes"],
                           item.get("batch", 1), item.get("gbps"), item.get("raw", ""), item.get("raw_gbps"),
                           item.get("p50_us"), item.get("p99_us"), **extra))
    return rows


# ---------------------------------------------------------------------------- machine


def machine_info() -> dict:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    info = {"cpu_model": _cpu_model(), "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_bytes": _meminfo("MemTotal"), "memory_available_bytes": _meminfo("MemAvailable"),
            "kernel": platform.release(), "platform": platform.platform(), "hostname": socket.gethostname(),
            "python": sys.version.split()[0], "python_implementation": platform.python_implementation()}
    for name in ("statetier", "torch", "uvloop", "blake3", "xxhash", "redis", "hiredis", "lmdb", "cryptography"):
        info[name] = version(name)
    info["git_commit"] = _git_commit()
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _git_commit() -> str | None:
    root = checkout_root()
    if root is None or not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=root,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def checkout_root() -> Path | None:
    """The source checkout the package runs from (``statetier/__init__.py`` maps it), if any."""
    import statetier

    root = Path(statetier.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() else None


def benchmarks_dir(given: str | None) -> Path | None:
    if given:
        return Path(given)
    root = checkout_root()
    return root / "benchmarks" if root is not None and (root / "benchmarks").is_dir() else None


# ---------------------------------------------------------------------------- suites


def run_script_suite(name: str, directory: Path | None, quick: bool, workdir: Path, tmp_dir: str | None) -> dict:
    """Run ``benchmarks/<name>.py`` in a subprocess; its table goes to our stdout."""
    script = directory / SCRIPT_SUITES[name] if directory is not None else None
    if script is None or not script.is_file():
        where = script or "benchmarks/ (no source checkout: an installed statetier ships only the SDK benchmark)"
        print(f"\n== {name}: MISSING — {where} not found; pass --benchmarks DIR of a statetier checkout", flush=True)
        return {"status": "missing", "script": str(script) if script else None, "rows": []}
    out = workdir / f"{name}.json"
    command = [sys.executable, str(script), "--json", str(out)] + (["--quick"] if quick else [])
    if name in ("tiers", "workloads") and tmp_dir:
        command += ["--dir", tmp_dir]
    print(f"\n== {name}: {' '.join(command[1:])}", flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=script.parent.parent, timeout=600 if quick else 1800)
        returncode = done.returncode
    except subprocess.TimeoutExpired:
        returncode = -1
    seconds = time.perf_counter() - started
    if returncode != 0 or not out.is_file():
        print(f"== {name}: FAILED (exit status {returncode})", flush=True)
        return {"status": "failed", "script": str(script), "returncode": returncode, "seconds": seconds, "rows": []}
    data = json.loads(out.read_text())
    rows = seal_rows(data) if name == "seal" else tier_rows(data)
    return {"status": "ok", "script": str(script), "seconds": seconds, "rows": rows,
            "machine": data.get("machine"), "load_average_after": data.get("load_average_after")}


def run_sdk_suite(url: str | None, quick: bool, tmp_dir: str | None) -> dict:
    from .bench_sdk import FULL, QUICK, run_sdk  # lazy: torch and the client

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
            f" {_num(row['p50_us'], '.0f'):>9} {_num(row['p99_us'], '.0f'):>9}")


def format_phases(row: dict) -> str | None:
    """The measured phases of one call of ``row`` (µs), in the order a call runs them."""
    phases = row.get("phases_us")
    if not phases:
        return None
    order = ["client_copy", "round_trip", "frames", "daemon", "daemon_copy_and_seal", "daemon_seal",
             "daemon_open", "daemon_open_and_hash", "daemon_window_copy", "client_hash"]
    names = [n for n in order if n in phases] + sorted(set(phases) - set(order))
    load = row.get("load_average")
    return ("         phases µs: " + "  ".join(f"{n}={phases[n]:.0f}" for n in names)
            + (f"  (load {load[0]:.2f})" if load else ""))


def print_row(row: dict) -> None:
    print(format_row(row), flush=True)
    phases = format_phases(row)
    if phases:
        print(phases, flush=True)


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
    from .config import DEFAULT_CLIENT_URL

    parser = argparse.ArgumentParser(prog="statetier bench", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None,
                        help="benchmark the daemon already running there (default: start a private one)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about 40 s in all)")
    parser.add_argument("--json", metavar="FILE", help="also write the results and the machine as JSON")
    parser.add_argument("suite", nargs="*", metavar="SUITE",
                        help=f"run only these suites: {', '.join(SUITES)} (default: {', '.join(DEFAULT_SUITES)})")
    parser.add_argument("--dir", default=None, help="where temporary files go (default: the system temp dir)")
    parser.add_argument("--benchmarks", default=None, help="the benchmarks/ folder of a statetier checkout")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args([arg for arg in argv if arg != "--"])  # the CLI passes "--" through
    unknown = sorted(set(args.suite) - set(SUITES))
    if unknown:
        parser.error(f"unknown suite {unknown[0]!r}; suites are {', '.join(SUITES)}")
    if args.url == DEFAULT_CLIENT_URL:
        args.url = None  # the CLI's default address is not a request to benchmark a running daemon
    return args


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
    directory = benchmarks_dir(args.benchmarks)
    with tempfile.TemporaryDirectory(prefix="statetier-bench-", dir=args.dir) as workdir:
        for name in suites_wanted:
            if name == "sdk":
                suites[name] = run_sdk_suite(args.url, args.quick, args.dir)
            else:
                suites[name] = run_script_suite(name, directory, args.quick, Path(workdir), args.dir)
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


def write_json(path: str | Path, rows: list[dict], machine: dict, **extra) -> None:
    """The one JSON object other tools read: ``{"results": rows, "machine": machine, **extra}``."""
    with open(path, "w") as handle:
        json.dump({"results": rows, "machine": machine, **extra}, handle, indent=2, default=str)
