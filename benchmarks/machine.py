"""The machine a benchmark ran on, and how busy it was apart from us.

- ``machine_info()`` — CPU model, cores, memory, kernel, Python, torch and library versions,
  git commit of the checkout (if any); callers add ``load_average_before`` / ``_after``.
- ``machine_brief()`` — the short form the seal and tiers suites print and add to: CPU model,
  cores (all, usable), load average, Python, platform; ``cpu_model()``, ``cpus_usable()``.
- ``background(seconds)`` → ``{"load_average", "busy_processes", "busy_cpu_percent",
  "busiest", "cpus", "seconds"}``: every process's CPU time is read from ``/proc`` twice,
  ``seconds`` apart; a process other than this one and its descendants that used at least
  ``BUSY_PERCENT`` of one CPU in between counts as busy. ``busiest`` names the top five
  (command name and percent of one CPU), so a reader can tell a compiler from a test run.

Linux only; elsewhere the counts are ``None`` and only the load average is given.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

BUSY_PERCENT = 10.0


def _processes() -> dict[int, tuple[int, str, float]]:
    """pid → (ppid, command name, CPU seconds so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                text = handle.read()
        except OSError:
            continue  # gone in between
        name = text[text.find("(") + 1 : text.rfind(")")]
        fields = text[text.rfind(")") + 2 :].split()
        out[int(entry)] = (int(fields[1]), name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _ours(processes: dict[int, tuple[int, str, float]]) -> set[int]:
    ours, frontier = {os.getpid()}, [os.getpid()]
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in ours:
                ours.add(child)
                frontier.append(child)
    return ours


def background(seconds: float = 1.0) -> dict:
    info: dict[str, Any] = {"load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "seconds": seconds,
            "busy_processes": None, "busy_cpu_percent": None, "busiest": []}
    if not os.path.isdir("/proc/self"):
        return info
    first = _processes()
    started = time.perf_counter()
    time.sleep(seconds)
    second = _processes()
    spent = time.perf_counter() - started
    ours = _ours(second) | _ours(first)
    busy = []
    for pid, (_, name, cpu) in second.items():
        if pid in ours or pid not in first:
            continue
        percent = (cpu - first[pid][2]) / spent * 100
        if percent >= BUSY_PERCENT:
            busy.append((round(percent, 1), name))
    busy.sort(reverse=True)
    info.update(busy_processes=len(busy), busy_cpu_percent=round(sum(p for p, _ in busy), 1),
                busiest=[{"name": name, "cpu_percent": percent} for percent, name in busy[:5]])
    return info


def machine_info() -> dict:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    info = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "cpus_usable": cpus_usable(),
            "memory_bytes": _meminfo("MemTotal"), "memory_available_bytes": _meminfo("MemAvailable"),
            "kernel": platform.release(), "platform": platform.platform(), "hostname": socket.gethostname(),
            "python": sys.version.split()[0], "python_implementation": platform.python_implementation()}
    for name in ("statetier", "torch", "uvloop", "blake3", "xxhash", "redis", "hiredis", "lmdb", "cryptography"):
        info[name] = version(name)
    info["git_commit"] = _git_commit()
    return info


def machine_brief() -> dict:
    return {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "cpus_usable": cpus_usable(),
            "load_average": list(os.getloadavg()), "python": sys.version.split()[0], "platform": platform.platform()}


def cpus_usable() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cpu_model() -> str:
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
    import statetier

    root = Path(statetier.__file__).resolve().parent.parent  # a source checkout maps the package here
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=root,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None
