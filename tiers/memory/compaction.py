"""Defragmentation of ``ExtentTier``: unleased objects slide down into free extents.

- ``Compaction`` — ``compact()`` of ``ExtentTier`` (a part ``tiers.memory.extent``
  composes; the state it uses is declared in ``ExtentTier.__init__``) → a
  ``CompactionReport``; the daemon's maintenance calls it when the region is fragmented.

A move copies an unleased object to a lower extent (``_move``, the medium's), then commits
only if the object is still there and still unleased. A lease granted during the copy reads
the old bytes, which nobody writes, and the move is abandoned (``compactions_blocked``). No
reader sees half-moved bytes, and leased bytes never move.
"""

from __future__ import annotations

from .placement import CompactionReport, Placement


class Compaction:
    """``ExtentTier``'s ``compact`` (see the module docstring)."""

    async def compact(self) -> CompactionReport:
        """Slide unleased objects down into free extents below them, highest first."""
        self._require_open()
        async with self._compaction:
            self.expire_leases()
            before = self._alloc.largest_free
            moved = bytes_moved = blocked = 0
            try:
                for oid, placement in sorted(self._places.items(), key=lambda item: -item[1].offset):
                    outcome = await self._maybe_move(oid, placement)
                    if outcome is None:
                        blocked += 1
                    elif outcome:
                        moved += 1
                        bytes_moved += placement.nbytes
            finally:
                after = self._alloc.largest_free if self._alloc is not None else before
                self.compactions_run += 1
                self.compactions_blocked += blocked
                self.bytes_moved += bytes_moved
                self.bytes_reclaimed += max(0, after - before)
        return CompactionReport(moved, bytes_moved, blocked, before, after)

    async def _maybe_move(self, oid: bytes, placement: Placement) -> bool | None:
        """True when moved, False when there was nowhere lower to go, None when a lease blocked it."""
        if self._places.get(oid) is not placement:
            return False
        dst = self._alloc.allocate_lowest(self._alloc.size_of(placement.offset), below=placement.offset)
        if dst is None:
            return False
        if self._leases.is_leased(oid):
            self._free_extent(dst)
            return None
        src, generation = placement.offset, placement.generation
        try:
            await self._move(src, dst, placement.nbytes)
        except BaseException:
            self._free_extent(dst)
            raise
        if self._places.get(oid) is not placement or placement.generation != generation or self._leases.is_leased(oid):
            self._free_extent(dst)
            return None if self._places.get(oid) is placement else False
        placement.offset, placement.generation = dst, next(self._generations)
        self._free_extent(src)
        return True
