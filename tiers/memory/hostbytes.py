"""The byte movers of an ``ExtentTier`` whose region is host memory.

- ``HostMemoryBytes`` — ``_write_chunks`` / ``_read_view`` / ``_copy_to`` / ``_copy_out`` /
  ``_move`` over ``_region`` (a memoryview at ``_region_address``), the medium's part of
  ``ExtentTier``. ``HostTier`` moves the arena's bytes with it; ``DeviceTier`` falls back on
  it (``super()``) when its pool is not on a CUDA device.

Copies up to ``inline_copy_bytes`` are ``memoryview`` slice assignments on the event loop;
larger ones run in the executor through ``ExtentTier._run_job`` (their extents pinned) with
``rawmemory.copy_bytes``, which releases the GIL. A read is a read-only view of the region,
no copy.
"""

from __future__ import annotations

from ..base import Buffer
from .placement import LeaseState, Placement
from .rawmemory import byte_view, copy_bytes, exported, exported_for_write, fresh_buffer


class HostMemoryBytes:
    """Host-memory byte movers (see the module docstring); the state is ``ExtentTier``'s."""

    async def _write_chunks(self, extent: int, position: int, views: list[memoryview]) -> None:
        if sum(v.nbytes for v in views) <= self._inline_copy_bytes:
            for view in views:
                self._region[position : position + view.nbytes] = view
                position += view.nbytes
            return
        await self._run_job((extent,), self._copy_in_job, position, views)

    def _copy_in_job(self, position: int, views: list[memoryview]) -> None:
        for view in views:
            with exported(view) as (address, nbytes):
                copy_bytes(self._region_address + position, address, nbytes)
            position += nbytes

    async def _read_view(self, state: LeaseState, placement: Placement) -> memoryview:
        return self._region[placement.offset : placement.offset + placement.nbytes].toreadonly()

    async def _copy_to(self, placement: Placement, dest: Buffer) -> None:
        if placement.nbytes <= self._inline_copy_bytes:
            byte_view(dest)[: placement.nbytes] = self._region[placement.offset : placement.offset + placement.nbytes]
            return
        await self._run_job((placement.offset,), self._copy_to_job, placement.offset, placement.nbytes, dest)

    def _copy_to_job(self, offset: int, nbytes: int, dest: Buffer) -> None:
        with exported_for_write(dest) as (address, _):
            copy_bytes(address, self._region_address + offset, nbytes)

    async def _copy_out(self, placements: list[Placement]) -> list[Buffer]:
        if not placements:
            return []
        if sum(p.nbytes for p in placements) <= self._inline_copy_bytes:
            return [bytes(self._region[p.offset : p.offset + p.nbytes]) for p in placements]
        items = [(p.offset, p.nbytes) for p in placements]
        return await self._run_job(tuple(offset for offset, _ in items), self._copy_out_job, items)

    def _copy_out_job(self, items: list[tuple[int, int]]) -> list[memoryview]:
        blobs = []
        for offset, nbytes in items:
            blob = fresh_buffer(nbytes)
            self._copy_to_job(offset, nbytes, blob)
            blobs.append(blob)
        return blobs

    async def _move(self, src: int, dst: int, nbytes: int) -> None:
        if nbytes <= self._inline_copy_bytes:
            self._region[dst : dst + nbytes] = self._region[src : src + nbytes]
            return
        await self._run_job((src, dst), copy_bytes, self._region_address + dst, self._region_address + src, nbytes)
