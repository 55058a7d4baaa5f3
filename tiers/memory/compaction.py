"""Defragmentation of an extent tier: unleased objects slide down into free extents.

- ``ExtentCompaction(ledger, region, loads)`` — ``compact()`` of ``ExtentTier``
  (``tiers.memory.extent``) → an ``ExtentCompactionReport``; the daemon's maintenance calls
  it when the region is fragmented. ``runs``, ``blocked``, ``bytes_moved`` and
  ``bytes_reclaimed`` count every pass.

A move copies an unleased object to a lower extent (the medium's ``move``), then commits
only if the object is still there and still unleased. A lease granted during the copy reads
the old bytes, which nobody writes, and the move is abandoned (``blocked``). No reader sees
half-moved bytes, and leased bytes never move.
"""

from __future__ import annotations

import asyncio

from ..ledger import Ledger
from .loads import ExtentLoads
from .records import ExtentCompactionReport, ObjectExtent
from .region import ExtentRegion, ExtentSpace


class ExtentCompaction:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[ObjectExtent], region: ExtentRegion, loads: ExtentLoads) -> None:
        self._ledger = ledger
        self._region = region
        self._loads = loads
        self._lock = asyncio.Lock()
        self.runs = self.blocked = self.bytes_moved = self.bytes_reclaimed = 0

    async def compact(self) -> ExtentCompactionReport:
        """Slide unleased objects down into free extents below them, highest first."""
        space = self._region.space
        async with self._lock:
            self._loads.expire_leases()
            before = space.alloc.largest_free
            moved = bytes_moved = blocked = 0
            try:
                for oid, place in sorted(space.places.items(), key=lambda item: -item[1].offset):
                    outcome = await self._maybe_move(space, oid, place)
                    if outcome is None:
                        blocked += 1
                    elif outcome:
                        moved += 1
                        bytes_moved += place.nbytes
            finally:
                after = space.alloc.largest_free if self._region.current is space else before
                self.runs += 1
                self.blocked += blocked
                self.bytes_moved += bytes_moved
                self.bytes_reclaimed += max(0, after - before)
        return ExtentCompactionReport(moved, bytes_moved, blocked, before, after)

    async def _maybe_move(self, space: ExtentSpace, oid: bytes, place: ObjectExtent) -> bool | None:
        """True when moved, False when there was nowhere lower to go, None when a lease blocked it."""
        if space.places.get(oid) is not place:
            return False
        dst = space.alloc.allocate_lowest(space.alloc.size_of(place.offset), below=place.offset)
        if dst is None:
            return False
        leases = self._ledger.leases
        if leases.is_leased(oid):
            space.free(dst)
            return None
        src, generation = place.offset, place.generation
        try:
            await space.bytes.move(src, dst, place.nbytes)
        except BaseException:
            space.free(dst)
            raise
        if space.places.get(oid) is not place or place.generation != generation or leases.is_leased(oid):
            space.free(dst)
            return None if space.places.get(oid) is place else False
        place.offset, place.generation = dst, space.next_generation()
        space.free(src)
        return True
