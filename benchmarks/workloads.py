"""Serving workloads against the raw limits of the same run: ``statetier bench workloads``.

Usage: ``python -m statetier.benchmarks.workloads [--quick] [--json FILE] [--dir DIR] [--only NAME …]
[--peer-transport tcp|nixl] [--peer-encrypt]``

Four parts, in this order (``--only`` picks some), each with a progress bar on stderr:

- ``limits``  — the 2 MiB raw limits (memcpy+BLAKE3, write+fdatasync, redis-py SET / GET)
  at the start and again at the end of the run (``workload_raw.limits``);
- ``pd``      — prefill → decode handoff of whole requests through Redis for Jamba-mini,
  Nemotron-H-8B and Qwen3-Next-80B at 2k and 8k tokens (``workload_pd``), two daemons
  and a redis-server (``statetier.launch.PDCluster``);
- ``peers``   — the same handoff with the daemons' peer tiers on (Redis the directory, the
  bytes pulled from prefill), against a plain loopback socket + BLAKE3 and redis-py
  SET+GET of the same bytes, with Redis's command and byte counts per handoff, and with
  ``--mooncake-python`` Mooncake Store's TCP put and get of the same objects in the same
  repetitions (``workload_peers``); ``--peer-transport nixl`` runs it (and ``prefix-peers``)
  with ``peers.transport = "nixl"`` (the daemons' Python needs the ``nixl`` extra; each row's
  ``transport`` says which); ``--peer-encrypt`` with ``peers.encrypt = true`` (the pulls
  sealed with AES-GCM: the rows' ``transport`` is ``tcp+aes-gcm``, their cost beside the clear
  rows of another run);
- ``prefix``  — multi-turn conversations restored by joint hits (``workload_prefix``);
- ``prefix-peers`` — the same conversations across two daemons with peer tiers, turns
  alternating between them, each turn restoring the previous one from the other daemon's
  memory (``workload_prefix.run_prefix_across``);
- ``clients`` — 1, 4 and 16 client processes putting and loading 2 MiB pages
  (``workload_clients``);
- ``sglang``  — the SGLang HiCache backend's ``batch_set_v1`` / ``batch_get_v1`` of 64 pages
  against the SDK's own batched put / load of the same pages (``workload_sglang``).

``--json FILE`` writes ``{"machine", "load_average_after", "seconds", "plan", "rows"}``, rows
in the schema of ``rows.result`` (``cli.py`` reads them as it
reads ``tiers.py``); every row also carries ``background``: the machine's load
and the other busy processes just before and after its workload (``machine.background``).
``--quick`` (2k tokens only, fewer turns, clients and repetitions) takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .machine import background
from .workload_models import MODELS
from .workload_prefix import PrefixPlan

PARTS = ("limits", "pd", "peers", "prefix", "prefix-peers", "clients", "sglang")


@dataclass(frozen=True)
class WorkloadPlan:
    pd_tokens: tuple[int, ...]
    pd_reps: int
    prefix: PrefixPlan
    client_levels: tuple[int, ...]
    client_pages: int
    client_reps: int
    sglang_pages: int
    sglang_reps: int
    limit_seconds: float
    background_seconds: float


FULL = WorkloadPlan((2048, 8192), 5, PrefixPlan(5, 7, 4, (2, 6)), (1, 4, 16), 8, 7, 64, 7, 3.0, 1.0)
QUICK = WorkloadPlan((2048,), 1, PrefixPlan(2, 3, 2, (1, 3)), (1, 4, 16), 2, 1, 64, 1, 0.5, 0.5)


class Progress:
    """A tqdm bar on stderr when it is a terminal; else (or where tqdm is not installed) a plain
    line per step, so a log carries no carriage-return bars."""

    def __init__(self, name: str, total: int) -> None:
        try:
            if not sys.stderr.isatty():
                raise ImportError("not a terminal: plain lines")
            from tqdm import tqdm
        except ImportError:
            self.bar, self.name, self.done, self.total = None, name, 0, total
        else:
            self.bar = tqdm(total=total, desc=f"{name:<8}", file=sys.stderr, unit="step", leave=True,
                            dynamic_ncols=True)

    def __call__(self, steps: int) -> None:
        if self.bar is not None:
            self.bar.update(steps)
        else:
            self.done += steps
            print(f"{self.name}: step {self.done}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_async(coro):
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


def run_limits(plan: WorkloadPlan, directory: Path, progress) -> dict[str, float]:
    from statetier.launch import RedisServer
    from .workload_raw import limits

    with RedisServer() as server:
        found = _run_async(limits(server.url, directory, plan.limit_seconds))
    progress(1)
    return found


def limit_rows(start: dict[str, float], end: dict[str, float]) -> list[dict]:
    """One row per raw path: ``gbps`` at the end, ``raw_gbps`` at the start (ratio = drift)."""
    tiers = {"memcpy+blake3": "memory", "write+fdatasync": "disk", "redis-py SET": "redis", "redis-py GET": "redis"}
    return [{"suite": "limits", "tier": tiers[name], "op": name, "size_bytes": 2 << 20, "batch": 1,
             "gbps": end[name], "raw": f"{name} at start", "raw_gbps": start[name], "ratio": end[name] / start[name],
             "p50_us": (2 << 20) / end[name] / 1e3, "p99_us": None, "metric": "throughput",
             "start_gbps": start[name], "end_gbps": end[name]} for name in start]


def run_pd(plan: WorkloadPlan, directory: Path, progress) -> list[dict]:
    from .workload_pd import run_pd as measure
    from statetier.launch import PDCluster

    cases = [(model, tokens) for tokens in plan.pd_tokens for model in MODELS]
    with PDCluster(host_capacity="1GiB", log_level="warning") as cluster:
        return _run_async(measure(cluster, cases, plan.pd_reps, progress))


def peer_settings(transport: str, encrypt: bool = False) -> dict[str, object]:
    return {"peers.enabled": "true", "peers.transport": transport, **({"peers.encrypt": "true"} if encrypt else {})}


def run_peers(plan: WorkloadPlan, directory: Path, progress, mooncake_python: str | None = None,
              transport: str = "tcp", encrypt: bool = False) -> list[dict]:
    from .workload_peers import run_peers as measure
    from statetier.launch import PDCluster

    cases = [(model, tokens) for tokens in plan.pd_tokens for model in MODELS]
    with PDCluster(host_capacity="1GiB", log_level="warning", settings=peer_settings(transport, encrypt)) as cluster:
        return _run_async(measure(cluster, cases, plan.pd_reps, progress, mooncake_python))


def run_prefix(plan: WorkloadPlan, directory: Path, progress) -> list[dict]:
    from .workload_prefix import run_prefix as measure
    from statetier.launch import PDCluster

    with PDCluster(host_capacity="256MiB", log_level="warning") as cluster:
        rows, turns = _run_async(measure(cluster.prefill, plan.prefix, directory, progress))
    for row in rows:
        row["per_turn"] = turns
    return rows


def run_prefix_peers(plan: WorkloadPlan, directory: Path, progress, transport: str = "tcp",
                     encrypt: bool = False) -> list[dict]:
    from .workload_peers import transport_label
    from .workload_prefix import run_prefix_across as measure
    from statetier.launch import PDCluster

    settings = peer_settings(transport, encrypt)
    with PDCluster(host_capacity="256MiB", log_level="warning", settings=settings) as cluster:
        rows, turns = _run_async(measure(cluster.prefill, cluster.decode, plan.prefix, directory, progress))
    for row in rows:
        row["per_turn"] = turns
        row["transport"] = transport_label(settings)
    return rows


def run_clients(plan: WorkloadPlan, directory: Path, progress) -> list[dict]:
    from .workload_clients import run_clients as measure

    home = Path(tempfile.mkdtemp(prefix="st-cl-", dir="/tmp"))  # AF_UNIX paths are short
    try:
        return _run_async(measure(plan.client_levels, plan.client_pages, plan.client_reps, home, progress))
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run_sglang(plan: WorkloadPlan, directory: Path, progress) -> list[dict]:
    from .workload_sglang import run_sglang as measure

    home = Path(tempfile.mkdtemp(prefix="st-sg-", dir="/tmp"))  # AF_UNIX paths are short
    try:
        return _run_async(measure(plan.sglang_pages, plan.sglang_reps, home, progress))
    finally:
        shutil.rmtree(home, ignore_errors=True)


def steps(plan: WorkloadPlan, part: str) -> int:
    return {"limits": 1, "pd": len(plan.pd_tokens) * len(MODELS) * (plan.pd_reps + 1),
            "peers": len(plan.pd_tokens) * len(MODELS) * (plan.pd_reps + 1),
            "prefix": plan.prefix.conversations * plan.prefix.turns,
            "prefix-peers": plan.prefix.conversations * plan.prefix.turns,
            "clients": len(plan.client_levels) * (plan.client_reps + 1),
            "sglang": plan.sglang_reps + 1}[part]


def run(plan: WorkloadPlan, parts: list[str], directory: Path, mooncake_python: str | None = None,
        peer_transport: str = "tcp", peer_encrypt: bool = False) -> list[dict]:
    rows: list[dict] = []
    start = None
    for part in parts:
        before = background(plan.background_seconds)
        progress = Progress(part, steps(plan, part))
        try:
            if part == "limits":
                start = run_limits(plan, directory, progress)
                continue
            if part == "peers":
                found = run_peers(plan, directory, progress, mooncake_python, peer_transport, peer_encrypt)
            elif part == "prefix-peers":
                found = run_prefix_peers(plan, directory, progress, peer_transport, peer_encrypt)
            else:
                found = {"pd": run_pd, "prefix": run_prefix, "clients": run_clients,
                         "sglang": run_sglang}[part](plan, directory, progress)
        finally:
            progress.close()
        after = background(plan.background_seconds)
        for row in found:
            row["background"] = {"before": before, "after": after}
        rows += found
    if start is not None:
        progress = Progress("limits", 1)
        end = run_limits(plan, directory, progress)
        progress.close()
        rows += limit_rows(start, end)
    return rows


def print_rows(rows: list[dict]) -> None:
    from .cli import HEAD, format_passes, format_row

    print(HEAD)
    print("-" * len(HEAD))
    passes_said = None
    for row in rows:
        print(format_row({**row, "suite": row["suite"][:6], "tier": row["tier"][:13], "op": row["op"][:6]}))
        passes = format_passes(row)
        if passes and passes != passes_said:  # once per case: its rows share the counts
            print(passes)
            passes_said = passes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="2k tokens, few turns and repetitions (about a minute)")
    parser.add_argument("--dir", default=None, help="where the raw file writes go (default: system temp)")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts")
    parser.add_argument("--mooncake-python", metavar="PYTHON", default=None,
                        help="the Python of a venv with Mooncake Store (../shared/peers/setup.sh mooncake: "
                             "/tmp/venv-mooncake/bin/python): the peers rows gain Mooncake's TCP put and get of the "
                             "same objects")
    parser.add_argument("--peer-transport", choices=("tcp", "nixl"), default="tcp",
                        help='the peers and prefix-peers parts with peers.transport = this ("nixl": NIXL over UCX; '
                             "this Python needs the nixl extra, UCX_TLS=tcp where no fabric is)")
    parser.add_argument("--peer-encrypt", action="store_true",
                        help="the peers and prefix-peers parts with peers.encrypt = true (pulls sealed with AES-GCM; "
                             'the rows\' transport "tcp+aes-gcm")')
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # copies single-threaded, as the SDK benchmark does (PERFORMANCE.md)
    from .machine import machine_info

    plan = QUICK if args.quick else FULL
    machine = {**machine_info(), "load_average_before": list(os.getloadavg())}
    print(f"workloads: {', '.join(args.only)}; {'quick' if args.quick else 'full'} plan; load "
          f"{', '.join(f'{x:.2f}' for x in machine['load_average_before'])}", flush=True)
    started = time.perf_counter()
    directory = Path(tempfile.mkdtemp(prefix="statetier-workloads-", dir=args.dir))
    try:
        rows = run(plan, [part for part in PARTS if part in args.only], directory, args.mooncake_python,
                   args.peer_transport, args.peer_encrypt)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    elapsed = time.perf_counter() - started
    print_rows(rows)
    after = list(os.getloadavg())
    print(f"\n{elapsed:.1f} s; load average after: {', '.join(f'{x:.2f}' for x in after)}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"machine": machine, "load_average_after": after, "seconds": elapsed,
                       "plan": asdict(plan), "rows": rows}, handle, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
