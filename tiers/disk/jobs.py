"""The disk tier's executor edge: blocking work off the event loop, foreign errors translated.

- ``DiskJobs(executor)`` — ``await run(fn, *args, pins=segments)`` runs ``fn`` in the
  executor. The segments stay pinned until the thread has *really* finished, even when
  the awaiting coroutine was cancelled first (a cancelled await does not stop a thread),
  so no file is deleted or closed under a running pread/pwritev. ``wait_idle()`` waits for
  every job still running (the tier's ``close``).
- ``translate_error(exc)`` — OSError ENOSPC/EFBIG/EDQUOT → ``CapacityError``, other OSError →
  ``Unavailable``; ``lmdb.MapFullError`` (or an LMDB write failing with those errnos) →
  ``CapacityError``, other ``lmdb.Error`` → ``InternalError``; statetier errors pass
  through. ``run`` raises the translation chained ``from`` the original, ``chained`` does
  the same for errors returned as values.
"""

from __future__ import annotations

import asyncio
import errno
from concurrent.futures import Executor, Future
from functools import partial
from typing import Any, Callable

import lmdb

from statetier.protocol.errors import CapacityError, InternalError, StatetierError, Unavailable
from .space import SegmentState

_CAPACITY_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def translate_error(exc: BaseException) -> StatetierError:
    """The statetier error for a foreign one met by the disk tier (the caller chains it)."""
    if isinstance(exc, StatetierError):
        return exc
    if isinstance(exc, OSError):
        if exc.errno in _CAPACITY_ERRNOS:
            return CapacityError(f"disk tier: {exc.strerror}")
        return Unavailable(f"disk tier I/O failed: {exc}")
    if isinstance(exc, lmdb.MapFullError):
        return CapacityError("disk tier index map is full")
    if isinstance(exc, lmdb.Error):
        if getattr(exc, "code", 0) in _CAPACITY_ERRNOS:
            return CapacityError(f"disk tier index: {exc}")
        return InternalError(f"disk tier index: {exc}")
    return InternalError(f"disk tier: {exc!r}")


def chained(exc: BaseException) -> StatetierError:
    translated = translate_error(exc)
    if translated is not exc:
        translated.__cause__ = exc
    return translated


class DiskJobs:
    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._loop = asyncio.get_running_loop()
        self._running: set[Future[Any]] = set()

    async def run(self, fn: Callable[..., Any], *args: Any, pins: tuple[SegmentState, ...] = ()) -> Any:
        for segment in pins:
            segment.pin()
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            for segment in pins:
                segment.unpin()
            raise
        self._running.add(job)
        waiter = self._loop.create_future()
        waiter.add_done_callback(partial(_cancel_unstarted, job))
        # one wake-up of the loop per job: it settles the waiter and the pins together
        job.add_done_callback(partial(self._finished_threadsafe, pins, waiter))
        try:
            return await waiter
        except StatetierError:
            raise
        except Exception as exc:
            raise translate_error(exc) from exc

    def _finished_threadsafe(self, pins: tuple[SegmentState, ...], waiter: asyncio.Future[Any],
                             job: Future[Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._finished, pins, waiter, job)
        except RuntimeError:  # the loop is gone: nobody is left to care about pins
            pass

    def _finished(self, pins: tuple[SegmentState, ...], waiter: asyncio.Future[Any], job: Future[Any]) -> None:
        self._running.discard(job)
        for segment in pins:
            segment.unpin()
        if waiter.done():
            return
        if job.cancelled():
            waiter.cancel()
        elif (error := job.exception()) is not None:
            waiter.set_exception(error)
        else:
            waiter.set_result(job.result())

    async def wait_idle(self) -> None:
        running = [asyncio.wrap_future(job) for job in self._running if not job.done()]
        if running:
            await asyncio.wait(running)


def _cancel_unstarted(job: Future[Any], waiter: asyncio.Future[Any]) -> None:
    if waiter.cancelled():
        job.cancel()  # only a job that has not started yet stops; a running one finishes
