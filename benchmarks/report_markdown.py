"""The text of ``docs/benchmarks.md`` from one ``statetier bench --json … sdk workloads`` document.

``render(document, run, plots, md_dir) -> str`` — ``document`` is the JSON ``statetier bench``
wrote; ``run`` what ``report.py`` saw around it (command, seconds, date, quick,
background before / after); ``plots`` the PNG paths by name, referenced relative to
``md_dir``. Sections: the machine and its load (with a plain statement when other work
was loading it), the headline, the raw limits of the run, then PD handoff, multi-turn
prefix reuse and concurrent clients, each a table whose every row has its ratio to a raw
limit measured in the same run, the same-host hot path through the SDK (every issue-10
target row, its machine load and the measured phases of one call), and the method. Every table is a results table.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .report_recompute import recompute_section
from .workload_models import MODELS

MiB = 1024 * 1024
QUIET_LOAD_PER_CPU = 0.25  # a 1-minute load average below this per CPU counts as quiet


def _f(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _background_text(snapshot: dict) -> str:
    load = ", ".join(f"{x:.2f}" for x in snapshot["load_average"])
    if snapshot.get("busy_processes") is None:
        return f"load average {load}"
    if not snapshot["busy_processes"]:
        return f"load average {load}; no other busy process"
    busiest = ", ".join(f"{b['name']} {b['cpu_percent']:.0f}%" for b in snapshot["busiest"])
    return (f"load average {load}; {snapshot['busy_processes']} other busy process(es) using "
            f"{snapshot['busy_cpu_percent']:.0f}% of a CPU in all ({busiest})")


def _snapshots(document: dict, run: dict) -> list[dict]:
    found = [run["background_before"], run["background_after"]]
    for row in document["results"]:
        if row.get("background"):
            found += [row["background"]["before"], row["background"]["after"]]
    return found


def _load_verdict(document: dict, run: dict, cpus: int) -> str:
    """A plain statement of how loaded the machine was, from every background sample."""
    snaps = _snapshots(document, run)
    start_load = run["background_before"]["load_average"][0]
    busy = max(s.get("busy_processes") or 0 for s in snaps)
    busy_cpu = max(s.get("busy_cpu_percent") or 0 for s in snaps)
    if start_load / cpus < QUIET_LOAD_PER_CPU and busy == 0:
        return (f"The machine was quiet: 1-minute load average {start_load:.2f} on {cpus} CPUs when the run began, "
                f"and no other process was busy in any sample.")
    return (f"**Other work was loading this machine during the run** (other sessions share it): the 1-minute load "
            f"average was {start_load:.2f} on {cpus} CPUs when the run began (it counts everything that ran in the "
            f"minute before), and "
            f"samples between the workloads found up to {busy} other busy process(es) using up to {busy_cpu:.0f}% "
            f"of a CPU. Absolute GB/s are therefore lower and noisier than on a quiet machine; the ratios, whose "
            f"raw limits were measured in the same run under the same load, are the figures to compare.")


def machine_section(document: dict, run: dict) -> list[str]:
    m = document["machine"]
    cpus = m.get("cpus_usable") or m.get("cpus") or 1
    lines = ["## The machine and its load", "",
             f"- {m.get('cpu_model')}, {cpus} of {m.get('cpus')} CPUs usable, "
             f"{(m.get('memory_bytes') or 0) / 2**30:.0f} GiB memory, kernel {m.get('kernel')}",
             f"- Python {m.get('python')}, torch {m.get('torch')}, redis-py {m.get('redis')}, hiredis "
             f"{m.get('hiredis')}, blake3 {m.get('blake3')}, uvloop {m.get('uvloop')}; statetier "
             f"{m.get('statetier')} at {m.get('git_commit') or 'an installed package'}",
             f"- Before the run: {_background_text(run['background_before'])}",
             f"- After the run: {_background_text(run['background_after'])}"]
    for suite, name in (("pd", "PD handoff"), ("prefix", "prefix reuse"), ("clients", "concurrent clients")):
        row = next((r for r in document["results"] if r["suite"] == suite and r.get("background")), None)
        if row is not None:
            lines.append(f"- During {name}: before it {_background_text(row['background']['before'])}; after it "
                         f"{_background_text(row['background']['after'])}")
    return lines + ["", _load_verdict(document, run, cpus), ""]


def _by(rows: list[dict], suite: str) -> list[dict]:
    return [r for r in rows if r["suite"] == suite]


def headline_section(rows: list[dict]) -> list[str]:
    out = []
    pd = [r for r in _by(rows, "pd") if r["op"] == "handoff" and r["raw"] == "redis-py SET+GET"]
    longest = max((r["tokens"] for r in pd), default=None)
    for r in pd:
        if r["tokens"] == longest:
            out.append([f"PD handoff, {r['case']} ({r['size_bytes'] / MiB:.0f} MiB, {r['batch']} objects)",
                        _f(r["gbps"]), r["raw"], _f(r["raw_gbps"]), _f(r["ratio"])])
    for r in _by(rows, "prefix"):
        rate = "–" if r.get("hit_rate") is None else f"{r['hit_rate'] * 100:.0f}%"
        what = (f"lookup+load, hit rate {rate} ({r['tokens_restored']} of {r['tokens_possible']} tokens)"
                if r["op"] == "lookup+load" else r["op"])
        if r["op"] == "lookup+load" or r["raw"] == "write+fdatasync":
            out.append([f"Prefix reuse {what}", _f(r["gbps"]), r["raw"], _f(r["raw_gbps"]), _f(r["ratio"])])
    for r in _by(rows, "clients"):
        if r["clients"] == max(x["clients"] for x in _by(rows, "clients")):
            out.append([f"{r['clients']} concurrent clients, {r['op']} (aggregate)", _f(r["gbps"]),
                        f"{r['raw']} × {r['clients']} processes", _f(r["raw_gbps"]), _f(r["ratio"])])
    head = ["workload", "GB/s", "raw limit (same run)", "raw GB/s", "ratio"]
    return ["## Headline", "", *_table(head, out), "",
            "ratio = statetier GB/s ÷ raw GB/s on the same bytes in the same run (1.00 = as fast as the raw path; "
            "the raw paths seal nothing, verify nothing and cross no process boundary).", ""]


def limits_section(rows: list[dict]) -> list[str]:
    body = [[r["op"], _f(r["start_gbps"]), _f(r["end_gbps"]), _f(r["ratio"])] for r in _by(rows, "limits")]
    if not body:
        return []
    return ["## Raw limits of this run (2 MiB, one thread, best call)", "",
            *_table(["raw path", "GB/s at start", "GB/s at end", "ratio end ÷ start"], body), "",
            "How far the machine's own speed moved during the run: a ratio far from 1 means the background load "
            "changed while the workloads ran.", ""]


def pd_section(rows: list[dict], plot: str | None) -> list[str]:
    found = _by(rows, "pd")
    if not found:
        return []
    pairs: dict = {}
    for r in found:
        pairs.setdefault((r["case"], r["op"]), {})[_pd_raw_kind(r["raw"])] = r
    body = []
    for (case, op), pair in pairs.items():
        red, mem, best = pair["redis"], pair["mem"], pair.get("best")
        lookup = f" (lookup {red['lookup_ms']:.0f} ms)" if op == "lookup+load" else ""
        best_cells = [f"{best['raw']} {_f(best['raw_gbps'])}", _f(best["ratio"])] if best else ["–", "–"]
        body.append([case, f"{red['size_bytes'] / MiB:.1f}", str(red["batch"]), op + lookup,
                     _f(red["p50_us"] / 1e6, 3), _f(red["gbps"]), f"{red['raw']} {_f(red['raw_gbps'])}",
                     _f(red["ratio"]), *best_cells, _f(mem["raw_gbps"]), _f(mem["ratio"])])
    head = ["case", "MiB", "objects", "op", "s (median)", "GB/s", "redis-py GB/s", "ratio",
            "redis-py ×4 GB/s", "ratio ×4", "memcpy+BLAKE3 GB/s", "ratio"]
    geometry = [f"- **{m.display}**: {m.describe()}; {m.state_bytes(2048) / MiB:.0f} MiB at 2k tokens, "
                f"{m.state_bytes(8192) / MiB:.0f} MiB at 8k. Assumed: {m.assumption}." for m in MODELS]
    lines = ["## PD handoff of a whole request through Redis", "",
             "A prefill daemon stores every KV record and SSM snapshot of one request with `publish=True` (each put "
             "returns once the object is sealed in the host arena and written to Redis); a decode daemon on the same "
             "Redis asks for the joint hit of every layer, then loads what it found (Redis → verify → its arena → the "
             "client). Both daemons and the redis-server are separate processes (`statetier.launch.PDCluster`). "
             "Geometries (KV in bfloat16, one record per attention layer covering the whole prompt):", "",
             *geometry, "", *_table(head, body), "", _served_text(found), ""]
    lines += [f"![PD handoff GB/s next to the raw limits]({plot})", ""] if plot else []
    return lines


def peers_section(rows: list[dict]) -> list[str]:
    """The handoff across daemons over the peer transport, each row beside every raw path of the
    same repetitions (socket+BLAKE3, redis-py SET+GET, Mooncake Store's TCP put/get when run)."""
    found = _by(rows, "peers")
    if not found:
        return []
    body = [[r["case"], f"{r['size_bytes'] / MiB:.1f}", str(r["batch"]), r.get("transport", "tcp"), r["op"],
             _f(r["p50_us"] / 1e6, 3), _f(r["gbps"]), r["raw"], _f(r["raw_gbps"]), _f(r["ratio"])] for r in found]
    head = ["case", "MiB", "objects", "transport", "op", "s (median)", "GB/s", "raw (same repetitions)", "raw GB/s",
            "ratio"]
    return ["## PD handoff across daemons (peer transport)", "",
            "The same requests as above with both daemons' peer tiers on: the prefill daemon's "
            "`put_many(publish=True)` "
            "puts each object's descriptor in Redis (the directory) and keeps the bytes; the decode daemon's joint-hit "
            "lookup finds them there and its `load_many` pulls the bytes from the prefill daemon over an "
            "authenticated TCP connection, verifies them and hands them to its client. `handoff` = put+publish and "
            "lookup+load; `lookup+load` = the restore from a peer alone. Raw paths, in the same repetitions: the same "
            "bytes over one plain loopback socket with BLAKE3 on receipt, redis-py SET+GET, and (where the run was "
            "given `--mooncake-python`) Mooncake Store's TCP `batch_put_from` / `batch_get_into` of objects of the "
            "same sizes from the process that holds them (remote topology, nothing verified).", "",
            *_table(head, body), "", _served_text(found), ""]


def _pd_raw_kind(raw: str) -> str:
    """Which column a PD row's raw limit goes to: plain redis-py, the best redis-py, memcpy."""
    if raw.startswith("memcpy"):
        return "mem"
    return "best" if "×" in raw else "redis"  # "redis-py ×4 GET": the best; "redis-py GET": plain


def _served_text(found: list[dict]) -> str:
    """Which tier served the decode side's loads, per case (from its hit counters)."""
    cases: dict[str, Any] = {}
    for r in found:
        if r.get("served_by_tier") is not None:
            cases.setdefault(r["case"], r["served_by_tier"])
    if not cases:
        return "Tiers that served the decode side's loads: not recorded in this run."
    parts = [f"{case}: " + (", ".join(f"{t} {n}" for t, n in sorted(served.items())) or "none")
             for case, served in cases.items()]
    return ("Loads the decode daemon served, by the tier the bytes came from (its `statetier_hits_total`, all "
            "repetitions): " + "; ".join(parts) + ". The redis-py ratios above are against the tier that served.")


def prefix_section(rows: list[dict], plot: str | None) -> list[str]:
    found = _by(rows, "prefix")
    if not found:
        return []
    first = found[0]
    rate, hits, body = _prefix_figures(found)
    lines = ["## Multi-turn prefix reuse with joint hits", "",
             f"{first['conversations']} {first['model']} conversations of {first['turns']} turns, taking turns round "
             "robin against one daemon (host arena of 256 MiB + disk + Redis, so older turns are evicted to disk). "
             "All conversations share a system prompt. Each turn looks up the longest prefix every layer can restore "
             "(boundaries at every 256-token block), loads it, \"prefills\" the new tokens (synthetic tensors) and "
             "saves the new KV blocks and an SSM snapshot at the new end.", "",
             f"- Hit rate (tokens restored ÷ tokens possible): **{rate}** — {first['tokens_restored']} of "
             f"{first['tokens_possible']} tokens; tokens possible = what this conversation saved last (the shared "
             f"system prompt on a conversation's first turn)",
             f"- Objects served per tier (daemon counters): {hits}",
             *_served_tier_limits(found), "",
             *_table(["op", "MiB", "turns", "GB/s", "raw limit", "raw GB/s", "ratio", "p50 ms/turn", "p99 ms/turn"],
                     body), ""]
    lines += [f"![Tokens possible and restored per turn, and load GB/s]({plot})", ""] if plot else []
    return lines


def _prefix_figures(found: list[dict]) -> tuple[str, str, list[list[str]]]:
    """A prefix workload's hit rate, objects served per tier and table body (one row per row)."""
    first = found[0]
    rate = "–" if first.get("hit_rate") is None else f"{first['hit_rate'] * 100:.1f}%"
    hits = ", ".join(f"{tier} {n}" for tier, n in sorted(first.get("hits_by_tier", {}).items())) or "none"
    body = [[r["op"] + (f" (lookup {r['lookup_ms']:.0f} ms)" if r["op"] == "lookup+load" else ""),
             f"{r['size_bytes'] / MiB:.0f}", str(r["samples"]), _f(r["gbps"]), r["raw"], _f(r["raw_gbps"]),
             _f(r["ratio"]), _f(r["p50_us"] / 1e3, 1), _f(r["p99_us"] / 1e3, 1)] for r in found]
    return rate, hits, body


def prefix_peers_section(rows: list[dict]) -> list[str]:
    """The conversations across two daemons (``workload_prefix.run_prefix_across``)."""
    found = _by(rows, "prefix-peers")
    if not found:
        return []
    first = found[0]
    rate, hits, body = _prefix_figures([r for r in found if not r["raw"].startswith("served tier")])
    return ["## Multi-turn prefix reuse across daemons", "",
            f"The same {first['conversations']} conversations of {first['turns']} turns against two daemons with "
            "their peer tiers on, turns alternating between them: every save is published (its descriptor in the "
            "directory, its bytes kept by the daemon that served the turn), so each turn's joint hit restores the "
            "conversation's previous turn from the other daemon's memory over the peer transport, verified on "
            "arrival.", "",
            f"- Hit rate: **{rate}** — {first['tokens_restored']} of {first['tokens_possible']} tokens",
            f"- Objects served per tier (both daemons' counters): {hits}", "",
            *_table(["op", "MiB", "turns", "GB/s", "raw limit", "raw GB/s", "ratio", "p50 ms/turn", "p99 ms/turn"],
                    body), ""]


def _served_tier_limits(found: list[dict]) -> list[str]:
    load = next((r for r in found if r.get("pread_blake3_warm_gbps") is not None), None)
    if load is None:
        return []
    return [f"- Limit of the tier that served each byte: memcpy+BLAKE3 for the host's, `pread`+BLAKE3 of the same "
            f"bytes from a file for the disk's ({_f(load['pread_blake3_warm_gbps'])} GB/s with its pages cached, "
            f"{_f(load['pread_blake3_cold_gbps'])} GB/s with them dropped first); the disk served "
            f"{load['disk_fraction'] * 100:.0f}% of the loaded bytes (hits per tier and kind × object size)"]


def clients_section(rows: list[dict], plot: str | None) -> list[str]:
    found = sorted(_by(rows, "clients"), key=lambda r: (r["clients"], r["op"] != "put"))
    if not found:
        return []
    body = [[str(r["clients"]), r["op"], _f(r["gbps"]), _f(r["raw_gbps"]), _f(r["ratio"]), _f(r["p50_us"] / 1e3),
             _f(r["p99_us"] / 1e3), _f(r["raw_p50_us"] / 1e3), _f(r["raw_p99_us"] / 1e3), str(r["samples"])]
            for r in found]
    head = ["clients", "op", "aggregate GB/s", "raw GB/s", "ratio", "p50 ms", "p99 ms", "raw p50 ms", "raw p99 ms",
            "pages"]
    lines = ["## Concurrent clients", "",
             f"N client processes, each with its own connection and shared-memory windows, put "
             f"{found[0]['pages_per_client']} KV pages of 2 MiB each, one at a time, then load them back by "
             "`StateRef`; all N start together. The raw limit is the same N processes copying and BLAKE3-hashing "
             "the same pages at the same moment. Latencies are per page over every client and repetition.", "",
             *_table(head, body), ""]
    lines += [f"![Aggregate GB/s and p99 against the number of clients]({plot})", ""] if plot else []
    return lines


def sglang_section(rows: list[dict]) -> list[str]:
    found = _by(rows, "sglang")
    if not found:
        return []
    body = [[r["op"], str(r["pages"]), f"{r['page_bytes'] / MiB:.1f}", _f(r["p50_us"] / 1e3, 1), _f(r["gbps"]),
             r["raw"], _f(r["raw_p50_us"] / 1e3, 1), _f(r["raw_gbps"]), _f(r["ratio"]),
             _f(1 / r["ratio"] if r["ratio"] else None)] for r in found]
    head = ["op", "pages", "MiB a page", "ms (median)", "GB/s", "SDK call", "SDK ms", "SDK GB/s",
            "ratio (SDK ÷ backend)", "backend ÷ SDK (target ≤ 1.2)"]
    return ["## SGLang HiCache backend", "",
            "`statetier.clients.sglang`'s `batch_set_v1` / `batch_get_v1` of one batch of pages of a page-first KV "
            "host pool (SGLang's layout; a Qwen3-Next-80B-like page: 12 attention layers × 2 KV heads × 256, "
            "bfloat16, 64 tokens), against the SDK's own `put_many` / `load_many(into=…)` of the same pages "
            "into the same slots, in the same "
            "repetitions against one daemon (host tier, the connection's shared-memory windows).", "",
            *_table(head, body), ""]


SDK_ORDER = {"put": 0, "load": 1, "load_into": 2}
PHASE_ORDER = ["client_copy", "round_trip", "frames", "daemon", "daemon_per_item", "daemon_copy_and_seal",
               "daemon_seal", "daemon_open", "daemon_window_copy", "client_hash"]


def _phases_text(phases: dict | None) -> str:
    if not phases:
        return "–"
    names = [n for n in PHASE_ORDER if n in phases] + sorted(set(phases) - set(PHASE_ORDER) - {"window_steps"})
    steps = phases.get("window_steps")
    return (", ".join(f"{n.replace('_', ' ')} {phases[n]:.0f}" for n in names)
            + (f"; {steps:.0f} frames per call" if steps is not None else ""))


def sdk_section(rows: list[dict]) -> list[str]:
    """The same-host hot path through the SDK (``statetier bench sdk``): every target row of
    issue 10 with its ratio to the copy + BLAKE3 ceiling of the same run, the machine load
    beside it, and the measured phases of one call."""
    found = _by(rows, "sdk")
    if not found:
        return []
    throughput = sorted((r for r in found if r.get("metric") == "throughput"),
                        key=lambda r: (r["tier"] != "shm", r["size_bytes"], r["batch"], SDK_ORDER.get(r["op"], 9)))
    body = []
    for r in throughput:
        target = r.get("target")
        met = "" if target is None else ("yes" if r["ratio"] >= target else "**no**")
        load = r.get("load_average")
        body.append([f"{r['tier']} {r['op']}", f"{r['size_bytes'] / MiB:g}", str(r["batch"]), _f(r["p50_us"], 0),
                     _f(r["gbps"]), _f(r["raw_gbps"]), _f(r["ratio"], 3), _f(r.get("ratio_2t"), 3), _f(target),
                     met, _f(load[0]) if load else "–", _phases_text(r.get("phases_us"))])
    head = ["path and op", "MiB", "objects/call", "p50 µs", "GB/s", "copy+BLAKE3 GB/s", "ratio",
            "ratio to 2-thread copy+BLAKE3", "target", "met", "load (1 min)",
            "phases of one call, µs (median of traced calls)"]
    latency = [r for r in found if r.get("metric") == "latency"]
    lat_body = []
    for r in latency:
        target = r.get("target")
        met = "" if target is None else ("yes" if r["ratio"] >= target else "**no**")
        load = r.get("load_average")
        lat_body.append([r["op"], _f(r["p50_us"], 0), _f(r["p99_us"], 0), f"{r['raw']}", _f(r["raw_p50_us"], 0),
                         _f(r["ratio"], 3), _f(target), met, _f(load[0]) if load else "–"])
    lat_head = ["op", "p50 µs", "p99 µs", "compared with", "its p50 µs", "ratio", "target", "met", "load (1 min)"]
    return ["## Same-host hot path (SDK)", "",
            "Puts and loads of KV pages through `statetier.clients` over the Unix socket, with the connection's "
            "shared-memory windows (`shm`) and inline; `load` allocates the result tensors, `load_into` fills "
            "preallocated ones; batches travel as one `put_many` / `load_many` call (batch frames). The ratio is "
            "to a copy into a preallocated buffer plus BLAKE3, one thread, timed in the same repetition; every "
            "load is verified by the client where its bytes land. The phases are measured (`trace=`) on one-page "
            "calls of the shared-memory path: `frames` is the round trip minus the daemon's own time.", "",
            *_table(head, body), "",
            "Round trips: `lookup` (1 attention + 1 SSM layer, 1 boundary) and `ping` against a raw Unix-socket echo "
            "(target: p50 at most 3× raw, ratio ≥ 0.33); `lookup48x16` (48 layers × 16 boundaries, one request's "
            "chain) against a 1 ms budget.", "",
            *_table(lat_head, lat_body), ""]


METHOD = [
    "## Method", "",
    "- Every statetier figure is paired, repetition by repetition, with a raw path over the same bytes timed in the "
    "same run, so that the machine's load hits both: memcpy+BLAKE3 (a copy into a preallocated buffer plus "
    "BLAKE3, one thread — the least that sealing or verifying costs), write+fdatasync (`pwrite` + `fdatasync` per "
    "object, as the disk tier appends) and redis-py with hiredis (SET / GET in the Redis tier's 2 MiB chunks, one "
    "pipeline per tensor, on the same redis-server).",
    "- GB/s = bytes ÷ median time; the ratio is the median over repetitions of raw time ÷ statetier time (prefix "
    "reuse: total raw time ÷ total time over all turns).",
    "- PD: a warm-up repetition first, whose loaded bytes are compared with what was put; every repetition uses a "
    "new prefix and deletes its objects from both daemons afterwards, outside the timing.",
    "- Background load: `/proc` is read twice a few seconds apart before and after each workload; a process outside "
    "this run using ≥ 10% of a CPU counts as busy.",
    "- Regenerate: `python -m statetier.benchmarks.report` (needs `pip install -e '.[bench]'`); "
    "the numbers here come from "
    "the run described above and nothing in this file was written by hand.", "",
]


def render(document: dict, run: dict, plots: dict[str, Path | None], md_dir: Path) -> str:
    rel = {name: (os.path.relpath(path, md_dir) if path else None) for name, path in plots.items()}
    rows = document["results"]
    mode = "quick (`--quick`: 2k tokens only, few turns and repetitions)" if run["quick"] else "full"
    lines = ["# statetier benchmarks: serving workloads against raw limits", "",
             f"_Generated by `python -m statetier.benchmarks.report` on {run['date']} from one {mode} run of "
             f"`{run['command']}` ({run['seconds']:.0f} s in all). Do not edit by hand: rerun the script._", ""]
    lines += machine_section(document, run)
    lines += headline_section(rows)
    if rel.get("ratios"):
        lines += [f"![Every workload figure as a ratio to its raw limit]({rel['ratios']})", ""]
    lines += limits_section(rows)
    lines += pd_section(rows, rel.get("pd"))
    lines += peers_section(rows)
    lines += recompute_section(rows)
    lines += prefix_section(rows, rel.get("prefix"))
    lines += prefix_peers_section(rows)
    lines += clients_section(rows, rel.get("clients"))
    lines += sglang_section(rows)
    lines += sdk_section(rows)
    lines += METHOD
    return "\n".join(lines)
