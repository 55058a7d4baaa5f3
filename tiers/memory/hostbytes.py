"""The byte movers of an extent tier whose region is host memory.

- ``HostBytes(region, address, jobs, inline_copy_bytes)`` — the ``ByteMovers`` over
  ``region`` (a memoryview at ``address``): ``view`` / ``write_chunks`` / ``read_view`` /
  ``copy_to`` / ``copy_out`` / ``move``. ``HostArena`` moves the arena's bytes with it;
  ``DevicePool`` uses it when its pool is not on a CUDA device.

Copies up to ``inline_copy_bytes`` are ``memoryview`` slice assignments on the event loop;
larger ones run in the executor through ``PinnedJobs.run`` (their extents pinned) with
``rawmemory.copy_bytes``, which releases the GIL. A read is a read-only view of the region,
no copy.
"""

from __future__ import annotations

from typing import Sequence

from statetier.protocol.passes import PASSES

from ..base import Buffer
from .pins import PinnedJobs
from .rawmemory import byte_view, copy_bytes, exported, exported_for_write, fresh_buffer
from .records import LeaseState, ObjectExtent


class HostBytes:
    """See the module docstring."""

    def __init__(self, region: memoryview, address: int, jobs: PinnedJobs, inline_copy_bytes: int) -> None:
        self._region = region
        self._address = address
        self._jobs = jobs
        self._inline = inline_copy_bytes

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self._region[offset : offset + nbytes]

    async def write_chunks(self, extent: int, position: int, views: Sequence[memoryview]) -> None:
        nbytes = sum(v.nbytes for v in views)
        PASSES.count_copied(nbytes)  # a store's bytes copied into the arena (issue 25: passes)
        if nbytes <= self._inline:
            for view in views:
                self._region[position : position + view.nbytes] = view
                position += view.nbytes
            return
        await self._jobs.run((extent,), self._copy_in_job, position, views)

    def _copy_in_job(self, position: int, views: Sequence[memoryview]) -> None:
        for view in views:
            with exported(view) as (address, nbytes):
                copy_bytes(self._address + position, address, nbytes)
            position += nbytes

    async def read_view(self, state: LeaseState, place: ObjectExtent) -> memoryview:
        return self._region[place.offset : place.offset + place.nbytes].toreadonly()

    async def copy_to(self, place: ObjectExtent, dest: Buffer) -> None:
        if place.nbytes <= self._inline:
            byte_view(dest)[: place.nbytes] = self._region[place.offset : place.offset + place.nbytes]
            return
        await self._jobs.run((place.offset,), self._copy_to_job, place.offset, place.nbytes, dest)

    def _copy_to_job(self, offset: int, nbytes: int, dest: Buffer) -> None:
        with exported_for_write(dest) as (address, _):
            copy_bytes(address, self._address + offset, nbytes)

    async def copy_out(self, places: list[ObjectExtent]) -> list[Buffer]:
        if not places:
            return []
        if sum(p.nbytes for p in places) <= self._inline:
            return [bytes(self._region[p.offset : p.offset + p.nbytes]) for p in places]
        items = [(p.offset, p.nbytes) for p in places]
        blobs: list[Buffer] = await self._jobs.run(tuple(offset for offset, _ in items), self._copy_out_job, items)
        return blobs

    def _copy_out_job(self, items: list[tuple[int, int]]) -> list[Buffer]:
        blobs: list[Buffer] = []
        for offset, nbytes in items:
            blob = fresh_buffer(nbytes)
            self._copy_to_job(offset, nbytes, blob)
            blobs.append(blob)
        return blobs

    async def move(self, src: int, dst: int, nbytes: int) -> None:
        if nbytes <= self._inline:
            self._region[dst : dst + nbytes] = self._region[src : src + nbytes]
            return
        await self._jobs.run((src, dst), copy_bytes, self._address + dst, self._address + src, nbytes)
