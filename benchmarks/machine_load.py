"""How busy the machine is apart from us: load average and other processes using CPU.

- ``background(seconds)`` → ``{"load_average", "busy_processes", "busy_cpu_percent",
  "busiest", "cpus", "seconds"}``: every process's CPU time is read from ``/proc`` twice,
  ``seconds`` apart; a process other than this one and its descendants that used at least
  ``BUSY_PERCENT`` of one CPU in between counts as busy. ``busiest`` names the top five
  (command name and percent of one CPU), so a reader can tell a compiler from a test run.

Linux only; elsewhere the counts are ``None`` and only the load average is given.
"""

from __future__ import annotations

import os
import time

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
    info = {"load_average": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(), "seconds": seconds,
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
