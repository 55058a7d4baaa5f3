"""What every probe shares: its result, its clock, the processes it runs, its payloads.

- ``ProbeResult``  — one probe's row: the promise it checks, what "lost" and "wrong" mean
  for it, inputs tried, faults injected, lost, wrong served, crashes, hangs, other figures
  (``notes``) and the first violations found (``failures``, bounded).
- ``Budget(seconds, short)`` — a probe's share of the run: ``deadline()`` for its loops,
  ``scale(long, short)`` for its counts. Every loop is bounded by a count *and* a deadline.
- ``DaemonProcess``, ``RedisServer``, ``RedisCluster`` — the test suite's own helpers
  (``tests/daemon/daemon_procs.py``, ``tests/support/redis_procs.py``), reused as they are.
- ``payload(seed, size)`` / ``key_prefix(probe, seed)`` — deterministic bytes and prefix
  hashes, so that what a load returns can be checked against what its put sent.
- ``internal_errors(daemon)`` — tracebacks in the daemon's log: an input that met an
  untyped failure, counted by every probe that talks to a daemon.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from statetier.launch.daemons import DaemonFailed, DaemonProcess, remove_arena_of  # noqa: F401 - for the probes
from statetier.launch.redis_servers import RedisCluster, RedisServer  # noqa: F401 - the probes' servers

REPO = Path(__file__).resolve().parent.parent

MAX_FAILURES = 20


@dataclass
class ProbeResult:
    probe: str
    promise: str
    lost_means: str
    wrong_means: str
    inputs: int = 0
    faults: int = 0
    lost: int = 0
    wrong: int = 0
    crashes: int = 0
    hangs: int = 0
    internal_errors: int = 0
    seconds: float = 0.0
    notes: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)

    def fail(self, text: str) -> None:
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(text)

    def add(self, name: str, amount: float = 1) -> None:
        self.notes[name] = self.notes.get(name, 0) + amount

    @property
    def is_clean(self) -> bool:
        return not (self.lost or self.wrong or self.crashes or self.hangs or self.internal_errors or self.failures)


@dataclass(frozen=True)
class Budget:
    seconds: float
    short: bool

    def deadline(self, fraction: float = 1.0) -> float:
        return time.monotonic() + self.seconds * fraction

    def scale(self, long: int, short: int) -> int:
        return short if self.short else long


def passed(deadline: float) -> bool:
    return time.monotonic() >= deadline


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def key_prefix(probe: str, seed: int) -> bytes:
    return hashlib.sha256(f"{probe}:{seed}".encode()).digest()


def internal_errors(daemon: DaemonProcess) -> int:
    return daemon.log_text().count("Traceback (most recent call last)")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
