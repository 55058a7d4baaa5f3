"""What every probe shares: its result, its clock, the processes it runs, its payloads.

- ``Promise(text, lost_means, wrong_means)`` — what a probe checks and what "lost" and
  "wrong" mean for it: each probe module's ``PROMISE``, the head of its row.
- ``ProbeResult``  — one probe's row (``ProbeResult.of(probe, promise)``, filled by the
  probe's ``run(budget, result)``, timed by ``run.py``): inputs tried, faults injected, lost,
  wrong served, crashes, hangs, other figures (``notes``) and the first violations found
  (``failures``, bounded).
- ``note_failures(result, label)`` — a step of a probe that may fail (a typed error, an
  ``OSError``, ``RuntimeError`` or failed assertion) without ending the probe: the failure
  becomes one of the row's ``failures`` and the probe goes on.
- ``Budget(seconds, short)`` — a probe's share of the run: ``deadline()`` for its loops,
  ``scale(long, short)`` for its counts. Every loop is bounded by a count *and* a deadline.
- ``DaemonProcess``, ``RedisServer``, ``RedisCluster`` (``DaemonFailed``)
  — ``statetier.launch``, the processes the tests and benchmarks start too.
- ``payload(seed, size)`` / ``key_prefix(probe, seed)`` — deterministic bytes and prefix
  hashes, so that what a load returns can be checked against what its put sent.
- ``started_again(daemon, result, what)`` — restarts a stopped or killed daemon; one that
  does not come back is a crash (noted as ``what``) and the answer is False.
- ``internal_errors(daemon)`` — tracebacks in the daemon's log: an input that met an
  untyped failure, counted by every probe that talks to a daemon.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from statetier.launch.daemons import DaemonFailed, DaemonProcess  # noqa: F401 - for the probes
from statetier.launch.redis_cluster import RedisCluster  # noqa: F401 - the probes' servers
from statetier.launch.redis_servers import RedisServer  # noqa: F401 - the probes' servers
from statetier.protocol.errors import StatetierError

REPO = Path(__file__).resolve().parent.parent

MAX_FAILURES = 20
STEP_FAILURES = (StatetierError, OSError, RuntimeError, AssertionError)


@dataclass(frozen=True)
class Promise:
    text: str
    lost_means: str
    wrong_means: str


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

    @classmethod
    def of(cls, probe: str, promise: Promise) -> "ProbeResult":
        return cls(probe, promise.text, promise.lost_means, promise.wrong_means)

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


@contextmanager
def note_failures(result: ProbeResult, label: str, *also: type[BaseException]) -> Iterator[None]:
    """The block's failure (``STEP_FAILURES``, and ``also``) noted as ``label: error``; the probe goes on."""
    try:
        yield
    except (*STEP_FAILURES, *also) as exc:
        result.fail(f"{label}: {exc!r}"[:500])


def passed(deadline: float) -> bool:
    return time.monotonic() >= deadline


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def key_prefix(probe: str, seed: int) -> bytes:
    return hashlib.sha256(f"{probe}:{seed}".encode()).digest()


def started_again(daemon: DaemonProcess, result: ProbeResult, what: str) -> bool:
    try:
        daemon.start()
    except DaemonFailed as exc:
        result.crashes += 1
        result.fail(f"{what}: {str(exc)[-400:]}")
        return False
    return True


def internal_errors(daemon: DaemonProcess) -> int:
    return daemon.log_text().count("Traceback (most recent call last)")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
