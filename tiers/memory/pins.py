"""Executor copies that pin the extents they touch, and frees that wait for them.

- ``PinnedJobs(executor, loop, alloc, translate, name)`` — made when an ``ExtentRegion`` opens:
  - ``run(extents, fn, *args)`` runs ``fn`` in the executor with ``extents`` pinned until
    it ends, even when the caller is cancelled; errors come back as statetier errors
    (``MemoryError`` as ``CapacityError``, others through ``translate``);
  - ``free(extent)`` gives an extent back to the allocator, or, while a job pins it, when
    the last such job ends — so a cancelled write or move never scribbles on space that
    was handed out again;
  - ``wait_all()`` lets the jobs still running land (``ExtentTier.close``), ``detach()``
    stops deferred frees reaching an allocator that is gone.

Bookkeeping runs on the event loop only; executor threads only copy bytes.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor, Future
from typing import Any, Callable

from statetier.protocol.errors import CapacityError, StatetierError

from statetier.protocol.extents import ExtentAllocator


class PinnedJobs:
    """See the module docstring."""

    def __init__(self, executor: Executor, loop: asyncio.AbstractEventLoop, alloc: ExtentAllocator,
                 translate: Callable[[Exception], StatetierError], name: str) -> None:
        self._executor, self._loop = executor, loop
        self._alloc: ExtentAllocator | None = alloc
        self._translate, self._name = translate, name
        self._pins: dict[int, int] = {}
        self._deferred_frees: set[int] = set()
        self._jobs: set[Future[Any]] = set()

    async def run(self, extents: tuple[int, ...], fn: Callable[..., Any], *args: Any) -> Any:
        for extent in extents:
            self._pins[extent] = self._pins.get(extent, 0) + 1
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            self._unpin(extents)
            raise
        self._jobs.add(job)
        loop = self._loop
        # the callback takes the job as its argument: closing over it would make a cycle
        # (job → callbacks → closure → job) that keeps the job's result — copies of whole
        # objects — alive until the garbage collector runs
        job.add_done_callback(lambda done: loop.call_soon_threadsafe(self._job_finished, done, extents))
        try:
            return await asyncio.wrap_future(job)
        except (StatetierError, asyncio.CancelledError):
            raise
        except MemoryError as exc:
            raise CapacityError(f"{self._name}: out of memory while copying") from exc
        except Exception as exc:
            raise self._translate(exc) from exc

    def free(self, extent: int) -> None:
        if self._pins.get(extent):
            self._deferred_frees.add(extent)
        elif self._alloc is not None:
            self._alloc.free(extent)

    async def wait_all(self) -> None:
        if self._jobs:  # copies still running for cancelled callers: let them land
            await asyncio.gather(*(asyncio.wrap_future(job) for job in list(self._jobs)), return_exceptions=True)

    def detach(self) -> None:
        self._alloc = None

    def _job_finished(self, job: Future[Any], extents: tuple[int, ...]) -> None:
        self._jobs.discard(job)
        self._unpin(extents)

    def _unpin(self, extents: tuple[int, ...]) -> None:
        for extent in extents:
            left = self._pins[extent] - 1
            if left:
                self._pins[extent] = left
                continue
            del self._pins[extent]
            if extent in self._deferred_frees:
                self._deferred_frees.discard(extent)
                if self._alloc is not None:
                    self._alloc.free(extent)
