"""Per-request phase timings, for ``statetier bench``'s breakdown of one call.

A request whose meta has ``"trace": true`` runs with a fresh dict in ``TRACE`` (a
``ContextVar``: it follows the request's task and nothing else); code on its path wraps a
phase in ``with phase("seal"):`` and the handler returns the dict, in microseconds, as the
reply's ``trace``. Untraced requests pay one ``ContextVar.get`` per phase.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar

TRACE: ContextVar[dict | None] = ContextVar("statetier_trace", default=None)


@contextmanager
def phase(name: str):
    timings = TRACE.get()
    if timings is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + (time.perf_counter() - started) * 1e6
