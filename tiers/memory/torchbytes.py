"""The byte movers of a device pool, as torch copies.

- ``TorchBytes(torch, pool, stream, jobs, single_thread_copies)`` — ``write_tensor`` (a
  tensor's bytes into the pool, on ``cpu`` too) for ``DeviceTier.write_from_tensor``, and
  on CUDA (``stream`` set) the pool's ``ByteMovers``: ``write_chunks`` / ``read_view`` /
  ``copy_to`` / ``copy_out`` / ``move``; ``view`` is None (no host view). A pool on ``cpu``
  moves its other bytes with ``HostBytes``.

On CUDA every copy is queued on the pool's side stream (``non_blocking``; a DMA when the host side
is pinned, such as the host tier's registered arena) and each job, in an executor thread
through ``PinnedJobs.run``, ends by recording a blocking-sync ``torch.cuda.Event`` and
calling ``event.synchronize()``: the thread sleeps in the driver until the copy is done, so
the loop never blocks and no core spins. Each job waits for its own copies inside the scope
that keeps its host buffers exported. ``single_thread_copies=True`` calls
``torch.set_num_threads(1)`` in each executor thread before its first torch copy.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Any, Callable, Sequence

from ..base import Buffer
from .pins import PinnedJobs
from .rawmemory import exported, exported_for_write, fresh_buffer, view_at
from .records import LeaseState, ObjectExtent


class TorchBytes:
    """See the module docstring."""

    def __init__(self, torch: Any, pool: Any, stream: Any, jobs: PinnedJobs, single_thread_copies: bool) -> None:
        self._torch, self._pool, self._stream, self._jobs = torch, pool, stream, jobs
        self._single_thread_copies = single_thread_copies
        self._thread_state = threading.local()

    def view(self, offset: int, nbytes: int) -> memoryview | None:
        return None

    def _on_stream(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` in this executor thread with the side stream current (on CUDA)."""
        torch = self._torch
        if self._single_thread_copies and not getattr(self._thread_state, "is_single", False):
            torch.set_num_threads(1)
            self._thread_state.is_single = True
        if self._stream is None:
            return fn(*args)
        with torch.cuda.stream(self._stream):
            return fn(*args)

    def _wait_side_stream(self) -> None:
        """Sleep in the driver until the side stream's copies so far are done."""
        if self._stream is not None:
            done = self._torch.cuda.Event(blocking=True)
            done.record(self._stream)
            done.synchronize()

    def _host_tensor(self, address: int, nbytes: int) -> Any:
        return self._torch.frombuffer(view_at(address, nbytes), dtype=self._torch.uint8)

    async def write_tensor(self, extent: int, position: int, flat: Any) -> None:
        """Copy a flat ``uint8`` tensor (any device) into the pool at ``position``."""
        await self._jobs.run((extent,), self._on_stream, self._copy_tensor_job, position, flat)

    def _copy_tensor_job(self, position: int, flat: Any) -> None:
        self._pool[position : position + flat.numel()].copy_(flat, non_blocking=self._stream is not None)
        self._wait_side_stream()

    async def write_chunks(self, extent: int, position: int, views: Sequence[memoryview]) -> None:
        await self._jobs.run((extent,), self._on_stream, self._host_to_device_job, position, views)

    def _host_to_device_job(self, position: int, views: Sequence[memoryview]) -> None:
        with ExitStack() as held:
            for view in views:
                address, nbytes = held.enter_context(exported(view))
                if nbytes:
                    self._pool[position : position + nbytes].copy_(self._host_tensor(address, nbytes),
                                                                   non_blocking=True)
                position += nbytes
            self._wait_side_stream()

    async def read_view(self, state: LeaseState, place: ObjectExtent) -> memoryview:
        staging = await self._jobs.run((place.offset,), self._on_stream, self._to_staging_job,
                                       place.offset, place.nbytes)
        state.keepalive.append(staging)
        return view_at(staging.data_ptr(), place.nbytes).toreadonly()

    def _to_staging_job(self, offset: int, nbytes: int) -> Any:
        torch = self._torch
        staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # torch caches these
        staging.copy_(self._pool[offset : offset + nbytes], non_blocking=True)
        self._wait_side_stream()
        return staging

    async def copy_to(self, place: ObjectExtent, dest: Buffer) -> None:
        await self._jobs.run((place.offset,), self._on_stream, self._device_to_host_job,
                             [(place.offset, place.nbytes, dest)])

    def _device_to_host_job(self, items: list[tuple[int, int, Buffer]]) -> None:
        with ExitStack() as held:
            for offset, nbytes, dest in items:
                address, _ = held.enter_context(exported_for_write(dest))
                self._host_tensor(address, nbytes).copy_(self._pool[offset : offset + nbytes], non_blocking=True)
            self._wait_side_stream()

    async def copy_out(self, places: list[ObjectExtent]) -> list[Buffer]:
        items: list[tuple[int, int, Buffer]] = [(p.offset, p.nbytes, fresh_buffer(p.nbytes)) for p in places]
        await self._jobs.run(tuple(p.offset for p in places), self._on_stream, self._device_to_host_job, items)
        return [blob for _, _, blob in items]

    async def move(self, src: int, dst: int, nbytes: int) -> None:
        await self._jobs.run((src, dst), self._on_stream, self._move_job, src, dst, nbytes)

    def _move_job(self, src: int, dst: int, nbytes: int) -> None:
        self._pool[dst : dst + nbytes].copy_(self._pool[src : src + nbytes], non_blocking=True)
        self._wait_side_stream()
