"""The PNG plots of ``docs/benchmarks.md`` (matplotlib, no display needed).

Each function takes the JSON rows of one ``statetier bench workloads`` run and a folder,
writes one PNG there and returns its path (``None`` when the run has no such rows):

- ``plot_ratios``  — every workload figure as its ratio to the raw limit of the same run;
- ``plot_pd``      — PD handoff GB/s per model and length, next to redis-py SET+GET and
  memcpy+BLAKE3 of the same bytes;
- ``plot_prefix``  — per turn: tokens possible and restored, and load GB/s;
- ``plot_clients`` — aggregate GB/s and p99 per page against the number of clients.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"statetier": "#2f6db5", "redis": "#d98c1f", "memory": "#6a9a3a", "disk": "#8c5aa8"}


def _save(fig, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def label(row: dict) -> str:
    if row["suite"] == "pd":
        return f"PD {row['case']} {row['op']} vs {row['raw']}"
    if row["suite"] == "clients":
        return f"{row['clients']} clients {row['op']} vs {row['raw']}"
    return f"{row['suite']} {row['op']} vs {row['raw']}"


def plot_ratios(rows: list[dict], folder: Path) -> Path | None:
    chosen = [r for r in rows if r["suite"] in ("pd", "prefix", "clients") and r.get("ratio") is not None]
    if not chosen:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(chosen) + 1.2))
    colors = {"pd": COLORS["redis"], "prefix": COLORS["disk"], "clients": COLORS["statetier"]}
    ax.barh(range(len(chosen)), [r["ratio"] for r in chosen], color=[colors[r["suite"]] for r in chosen])
    ax.set_yticks(range(len(chosen)), [label(r) for r in chosen], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio to the raw limit of the same run (1 = as fast as the raw path)")
    return _save(fig, folder, "ratios.png")


def plot_pd(rows: list[dict], folder: Path) -> Path | None:
    handoff = [r for r in rows if r["suite"] == "pd" and r["op"] == "handoff"]
    if not handoff:
        return None
    cases = list(dict.fromkeys(r["case"] for r in handoff))
    by = {(r["case"], r["raw"]): r for r in handoff}
    x = range(len(cases))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.27
    series = [("statetier handoff", [by[(c, "redis-py SET+GET")]["gbps"] for c in cases], COLORS["statetier"]),
              ("redis-py SET+GET", [by[(c, "redis-py SET+GET")]["raw_gbps"] for c in cases], COLORS["redis"]),
              ("memcpy+BLAKE3", [by[(c, "memcpy+blake3")]["raw_gbps"] for c in cases], COLORS["memory"])]
    for i, (name, values, color) in enumerate(series):
        ax.bar([p + (i - 1) * width for p in x], values, width, label=name, color=color)
    ax.set_xticks(list(x), cases, rotation=20, fontsize=8)
    ax.set_ylabel("GB/s (state bytes ÷ time)")
    ax.set_title("PD handoff of a whole request through Redis: put+publish, lookup+load")
    ax.legend(fontsize=8)
    return _save(fig, folder, "pd.png")


def plot_prefix(rows: list[dict], folder: Path) -> Path | None:
    found = [r for r in rows if r["suite"] == "prefix" and r.get("per_turn")]
    if not found:
        return None
    turns = found[0]["per_turn"]
    x = range(len(turns))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([p - 0.2 for p in x], [t["possible"] for t in turns], 0.4, label="tokens possible", color="#bbbbbb")
    ax.bar([p + 0.2 for p in x], [t["restored"] for t in turns], 0.4, label="tokens restored", color=COLORS["disk"])
    ax.set_xticks(list(x), [f"c{t['conversation']}t{t['turn']}" for t in turns], rotation=90, fontsize=7)
    ax.set_ylabel("tokens")
    ax.set_xlabel("turns in the order they ran (conversation c, turn t)")
    right = ax.twinx()
    speeds = [t["loaded_bytes"] / t["load_s"] / 1e9 if t["loaded_bytes"] else None for t in turns]
    right.plot([p for p, s in zip(x, speeds) if s], [s for s in speeds if s], "o-", color=COLORS["statetier"],
               label="lookup+load GB/s")
    right.set_ylabel("lookup+load GB/s")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], fontsize=8, loc="upper left")
    ax.set_title("Multi-turn prefix reuse (joint hits over every layer)")
    return _save(fig, folder, "prefix.png")


def plot_clients(rows: list[dict], folder: Path) -> Path | None:
    found = [r for r in rows if r["suite"] == "clients"]
    if not found:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for op, style in (("put", "o-"), ("load", "s-")):
        chosen = sorted((r for r in found if r["op"] == op), key=lambda r: r["clients"])
        n = [r["clients"] for r in chosen]
        left.plot(n, [r["gbps"] for r in chosen], style, label=f"statetier {op}")
        right.plot(n, [r["p99_us"] / 1e3 for r in chosen], style, label=f"statetier {op} p99")
        if op == "put":
            left.plot(n, [r["raw_gbps"] for r in chosen], "^--", color=COLORS["memory"], label="memcpy+BLAKE3")
            right.plot(n, [r["raw_p99_us"] / 1e3 for r in chosen], "^--", color=COLORS["memory"],
                       label="memcpy+BLAKE3 p99")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 4, 16], ["1", "4", "16"])
        ax.set_xlabel("concurrent client processes")
        ax.legend(fontsize=8)
    left.set_ylabel("aggregate GB/s (2 MiB pages)")
    right.set_ylabel("ms per 2 MiB page")
    fig.suptitle("Concurrent clients through one daemon (shared memory)")
    return _save(fig, folder, "clients.png")


PLOTS = (plot_ratios, plot_pd, plot_prefix, plot_clients)
