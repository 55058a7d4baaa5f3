"""The medium of an extent tier: one preallocated region, its extents, and what moves bytes.

- ``ExtentMedium`` — what a memory tier's medium does: ``open()`` / ``close()`` the region
  (executor thread), ``movers(jobs, inline_copy_bytes)`` → its ``ByteMovers``, ``translate``
  an error a copy job raised. ``HostArena`` (``tiers.memory.host``) and ``DevicePool``
  (``tiers.memory.device``) are the two.
- ``ByteMovers`` — how bytes get in and out of the region: ``write_chunks``, ``read_view``,
  ``copy_to``, ``copy_out``, ``move``, ``view`` (``HostBytes`` over host memory,
  ``TorchBytes`` over a CUDA pool).
- ``ExtentSpace`` — the region while it is open: the allocator, where each visible object
  lives (``places``), the executor jobs that pin extents, the movers; ``free(extent)``.
- ``ExtentRegion(medium, capacity, …)`` — opens and closes the medium and its space for the
  tier; ``space`` is it while open (``RuntimeError`` otherwise), ``current`` also while
  closing, ``free(extent)`` works until the space is gone.

The parts of an extent tier (``tiers.memory.stores``, ``loads``, ``removal``,
``compaction``) each receive the tier's ``Ledger`` and its ``ExtentRegion``.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Protocol, Sequence

from statetier.protocol.errors import StatetierError
from statetier.protocol.extents import ExtentAllocator

from ..base import Buffer
from .pins import PinnedJobs
from .records import LeaseState, ObjectExtent


class ByteMovers(Protocol):
    def view(self, offset: int, nbytes: int) -> memoryview | None:
        """A writable view of ``[offset, offset + nbytes)``; None when not host memory."""

    async def write_chunks(self, extent: int, position: int, views: Sequence[memoryview]) -> None:
        """Copy ``views`` into the region at ``position`` (inside ``extent``)."""

    async def read_view(self, state: LeaseState, place: ObjectExtent) -> memoryview:
        """A read-only view of the object (staging buffers kept in ``state``)."""

    async def copy_to(self, place: ObjectExtent, dest: Buffer) -> None: ...

    async def copy_out(self, places: list[ObjectExtent]) -> list[Buffer]:
        """Fresh copies of the objects (for eviction)."""

    async def move(self, src: int, dst: int, nbytes: int) -> None: ...


class ExtentMedium(Protocol):
    def open(self) -> None:
        """Create the region (in an executor thread)."""

    def close(self) -> None: ...

    def movers(self, jobs: PinnedJobs, inline_copy_bytes: int) -> ByteMovers: ...

    def translate(self, exc: Exception) -> StatetierError:
        """What a failed copy job raises."""


class ExtentSpace:
    """See the module docstring."""

    def __init__(self, alloc: ExtentAllocator, jobs: PinnedJobs, movers: ByteMovers) -> None:
        self.alloc = alloc
        self.jobs = jobs
        self.bytes = movers
        self.places: dict[bytes, ObjectExtent] = {}
        self._generations = itertools.count(1)
        self._touches = itertools.count(1)

    def place(self, object_id: bytes, offset: int, nbytes: int) -> ObjectExtent:
        place = ObjectExtent(offset, nbytes, next(self._generations), next(self._touches))
        self.places[object_id] = place
        return place

    def next_generation(self) -> int:
        return next(self._generations)

    def touch(self, place: ObjectExtent) -> None:
        place.touched = next(self._touches)

    def free(self, extent: int) -> None:
        self.jobs.free(extent)


class ExtentRegion:
    """See the module docstring."""

    def __init__(self, medium: ExtentMedium, name: str, capacity: int, granularity: int,
                 inline_copy_bytes: int, executor: Executor | None) -> None:
        self.medium = medium
        self.name = name
        self._capacity, self._granularity, self._inline = capacity, granularity, inline_copy_bytes
        self._given_executor = executor
        self._executor: Executor | None = None
        self._space: ExtentSpace | None = None
        self.is_open = False

    @property
    def space(self) -> ExtentSpace:
        if not self.is_open or self._space is None:
            raise RuntimeError(f"the {self.name} tier is not started (or already closed)")
        return self._space

    def require_open(self) -> None:
        """``RuntimeError`` unless open (``space`` raises it too)."""
        self.space  # noqa: B018

    @property
    def current(self) -> ExtentSpace | None:
        """The space while open or closing (bookkeeping that runs on until the close ends)."""
        return self._space

    def free(self, extent: int) -> None:
        if self._space is not None:
            self._space.free(extent)

    async def open(self) -> bool:
        """Open the medium and its space; False when it was open already."""
        if self.is_open:
            return False
        loop = asyncio.get_running_loop()
        self._executor = self._given_executor or ThreadPoolExecutor(2, thread_name_prefix=f"statetier-{self.name}")
        opening = self._executor.submit(self.medium.open)
        try:
            await asyncio.wrap_future(opening)
        except BaseException:
            opening.add_done_callback(self._close_if_opened)
            self._drop_executor()
            raise
        alloc = ExtentAllocator(self._capacity, self._granularity)
        jobs = PinnedJobs(self._executor, loop, alloc, self.medium.translate, self.name)
        self._space = ExtentSpace(alloc, jobs, self.medium.movers(jobs, self._inline))
        self.is_open = True
        return True

    def begin_close(self) -> ExtentSpace | None:
        """Refuse new work; the space stays (``current``) until ``finish_close``."""
        if not self.is_open:
            return None
        self.is_open = False
        return self._space

    async def finish_close(self, space: ExtentSpace) -> None:
        space.jobs.detach()
        self._space = None
        assert self._executor is not None
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.medium.close)
        finally:
            self._drop_executor()

    def _close_if_opened(self, done: Future[None]) -> None:
        if not done.cancelled() and done.exception() is None:
            self.medium.close()

    def _drop_executor(self) -> None:
        if self._given_executor is None and self._executor is not None:
            self._executor.shutdown(wait=False)
        self._executor = None
