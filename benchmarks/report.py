"""The benchmark report: run the serving workloads, write ``docs/benchmarks.md`` and its plots.

Usage: ``python -m statetier.benchmarks.report [--quick] [--out FILE.md] [--plots DIR] [--keep-json FILE]
[--from-json FILE] [--mooncake-python PYTHON]``

1. samples the machine's background load (``machine.background``);
2. runs ``python -m statetier.daemon bench --json FILE [--quick] sdk workloads`` as a
   subprocess (``sdk.py``: the same-host hot path and its per-phase
   breakdown; ``workloads.py``: PD handoff, multi-turn prefix reuse,
   concurrent clients, raw limits); its tables go to stdout, its progress bars to stderr;
3. samples the background load again;
4. writes the PNG plots (``report_plots``, into ``--plots``, default ``docs/benchmarks/``)
   and the markdown (``report_markdown``, ``--out``, default ``docs/benchmarks.md``),
   which references the plots by relative path.

``--from-json`` renders an earlier run's document instead of running (its background
samples are then unknown and the run's own load averages stand in). Exit status 1 when
the benchmark run failed (nothing is written then). The full run takes several minutes,
``--quick`` about a minute. Needs the ``bench`` extra (matplotlib, tqdm).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .machine import background

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

BACKGROUND_SECONDS = 2.0


def run_bench(quick: bool, json_path: Path, mooncake_python: str | None = None) -> tuple[int, str]:
    command = [sys.executable, "-m", "statetier.daemon", "bench", "--json", str(json_path)]
    command += ["--quick"] if quick else []
    command += ["--mooncake-python", mooncake_python] if mooncake_python else []
    command += ["sdk", "workloads"]
    shown = "statetier bench --json FILE" + (" --quick" if quick else "") + \
        (f" --mooncake-python {mooncake_python}" if mooncake_python else "") + " sdk workloads"
    print(f"report: running {' '.join(command[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=REPO, timeout=1800)
    return done.returncode, shown


def write_report(document: dict, run: dict, out: Path, plots_dir: Path) -> tuple[Path, list[Path]]:
    from .report_markdown import render
    from .report_plots import PLOTS

    rows = document["results"]
    plots = {}
    for plot in PLOTS:
        plots[plot.__name__.removeprefix("plot_")] = plot(rows, plots_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(document, run, plots, out.parent.resolve()) + "\n")
    return out, [p for p in plots.values() if p is not None]


def _stand_in_background(document: dict) -> tuple[dict, dict]:
    machine = document["machine"]
    return ({"load_average": machine.get("load_average_before", [0, 0, 0]), "busy_processes": None},
            {"load_average": machine.get("load_average_after", [0, 0, 0]), "busy_processes": None})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick plan (about a minute)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md", help="the markdown to write")
    parser.add_argument("--plots", type=Path, default=None, help="where the PNGs go (default: <out dir>/benchmarks)")
    parser.add_argument("--keep-json", type=Path, default=None, help="also keep the bench JSON here")
    parser.add_argument("--from-json", type=Path, default=None, help="render this bench JSON instead of running")
    parser.add_argument("--mooncake-python", default=None, metavar="PYTHON",
                        help="the peers rows beside Mooncake Store's TCP get (../shared/peers/setup.sh mooncake: "
                             "/tmp/venv-mooncake/bin/python)")
    args = parser.parse_args(argv)
    plots_dir = args.plots or args.out.parent / "benchmarks"
    started = time.perf_counter()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.from_json is not None:
        document = json.loads(args.from_json.read_text())
        before, after = _stand_in_background(document)
        quick = bool(document.get("options", {}).get("quick"))
        shown = "statetier bench --json FILE" + (" --quick" if quick else "") + " sdk workloads"
        seconds = document.get("seconds", 0.0)
    else:
        before = background(BACKGROUND_SECONDS)
        with tempfile.TemporaryDirectory(prefix="statetier-report-") as work:
            json_path = Path(work) / "bench.json"
            returncode, shown = run_bench(args.quick, json_path, args.mooncake_python)
            document = json.loads(json_path.read_text()) if json_path.is_file() else None
        after = background(BACKGROUND_SECONDS)
        seconds = time.perf_counter() - started
        failed = [n for n, s in (document or {}).get("suites", {}).items() if s.get("status") != "ok"]
        if returncode != 0 or document is None or failed or not document["results"]:
            print(f"report: the benchmark run failed (exit status {returncode}, suites {failed}); nothing written",
                  file=sys.stderr)
            return 1
        if args.keep_json is not None:
            args.keep_json.write_text(json.dumps(document, indent=2, default=str))
    run = {"command": shown, "seconds": seconds, "date": date, "quick": bool(document.get("options", {}).get("quick")),
           "background_before": before, "background_after": after}
    out, pngs = write_report(document, run, args.out, plots_dir)
    print(f"report: wrote {out} and {len(pngs)} plots in {plots_dir} ({seconds:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
