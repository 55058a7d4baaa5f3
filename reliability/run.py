"""``make chaos`` / ``make chaos-short``: run the eight probes, print the table, write the page.

``python reliability/run.py [--minutes 20] [--short] [--only crash,fuzz] [--write PATH]``

Each probe module has a ``PROMISE`` and ``run(budget, result)``, which fills the row this
module made and times. Each probe gets a share of the run (``SHARES``) as its deadline; every loop in it is also
bounded by a count. ``--short`` (≈ 2 minutes, CI) scales the counts down. The long run
writes ``docs/reliability.md`` unless ``--write ''``. Exit status 1 when any probe found a
violation (lost, wrong, crash, hang, internal error, or a failure it listed).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import probe_corruption  # noqa: E402
import probe_crash  # noqa: E402
import probe_faults  # noqa: E402
import probe_fuzz  # noqa: E402
import probe_load  # noqa: E402
import probe_owner  # noqa: E402
import probe_redis  # noqa: E402
import probe_security  # noqa: E402
import chaos_report as report  # noqa: E402
from harness import REPO, Budget, ProbeResult  # noqa: E402
from statetier.benchmarks.machine import background, cpu_model  # noqa: E402

PROBES = {"crash": probe_crash, "fuzz": probe_fuzz, "corruption": probe_corruption, "faults": probe_faults,
          "load": probe_load, "security": probe_security, "redis": probe_redis, "owner": probe_owner}
SHARES = {"crash": 0.40, "fuzz": 0.15, "corruption": 0.12, "faults": 0.12, "load": 0.14, "security": 0.02,
          "redis": 0.10, "owner": 0.08}
SHORT_SECONDS = 110.0


def _machine() -> str:
    memory = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return f"{os.cpu_count()} CPUs ({cpu_model()}), {memory / (1 << 20):.0f} GiB memory, {platform.platform()}"


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return (git("rev-parse", "--short=12", "HEAD") or "unknown") + dirty


async def _run(names: list[str], total: float, short: bool) -> list[ProbeResult]:
    results = []
    share = sum(SHARES[n] for n in names)
    for name in names:
        budget = Budget(total * SHARES[name] / share, short)
        print(f"[chaos] {name}: {budget.seconds:.0f} s", flush=True)
        result, started = ProbeResult.of(name, PROBES[name].PROMISE), time.monotonic()
        try:
            await PROBES[name].run(budget, result)
        except Exception as exc:  # noqa: BLE001 - a probe that breaks is a row that says so
            result = ProbeResult(name, "(probe failed to run)", "-", "-")
            result.fail(f"the probe itself failed: {exc!r}")
        result.seconds = time.monotonic() - started
        results.append(result)
        print(report.table([result]), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("CHAOS_MINUTES", 20)))
    parser.add_argument("--short", action="store_true", help="the CI run: about two minutes")
    parser.add_argument("--only", default="", help="comma-separated probes: " + ",".join(PROBES))
    parser.add_argument("--write", default=None, help="the page to write (default: docs/reliability.md for a long run)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(PROBES)
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        parser.error(f"unknown probes: {', '.join(unknown)}")
    total = SHORT_SECONDS if args.short else args.minutes * 60
    run = {"commit": _commit(), "started": datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"),
           "minutes": total / 60, "machine": _machine(), "load_before": background(1.0)}
    started = time.monotonic()
    results = asyncio.run(_run(names, total, args.short))
    run["seconds"] = time.monotonic() - started
    run["load_after"] = background(1.0)
    print()
    print(report.table(results))
    if report.kills_line(results):
        print(report.kills_line(results).replace("**", "").replace("`", ""))
    print(f"[chaos] {run['seconds']:.0f} s; load average before {run['load_before']['load_average']}, "
          f"after {run['load_after']['load_average']}")
    (REPO / ".chaos-results.json").write_text(json.dumps(
        {"run": run, "results": [r.__dict__ for r in results]}, indent=1, default=str))  # kept if the page fails
    target = args.write if args.write is not None else ("" if args.short else str(REPO / "docs" / "reliability.md"))
    if target:
        Path(target).write_text(report.markdown(results, run))
        print(f"[chaos] wrote {target}")
    return 0 if all(r.is_clean for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
