"""Free-extent allocation over one byte range: the one allocator of the package.

Sans-I/O, so every side uses it: the memory tiers' regions (host arena, device pool), the
daemon's per-connection load windows (``daemon.server.windows``) and the client's put window
(``clients.shm``).

- ``ExtentAllocator(capacity, granularity=4096)`` — hands out extents of a region that
  spans ``[0, capacity)``; sizes are rounded up to ``granularity``.
  ``allocate(size) -> offset | None``, ``free(offset)``, ``size_of(offset)``;
  ``allocate_lowest(size, below)`` is what compaction uses to slide an object down.
- ``free_bytes``, ``used_bytes``, ``largest_free`` and ``fragmentation`` (0 when all free
  space is one extent, towards 1 when it is scattered) feed the tier's stats.

Free extents sit in power-of-two size classes (class k holds sizes of 2^k..2^(k+1)-1
granules). ``allocate`` scans its own class first-fit, then takes the first extent of the
next non-empty class above, found with a bitmask. A free merges with both neighbours at
once through two maps (start → size, end → start), so the region never holds two adjacent
free extents. A buddy allocator would round a 2 MiB page plus its header up to 4 MiB;
this one wastes at most one granule per object.
"""

from __future__ import annotations

from typing import Iterator


class ExtentAllocator:
    """First fit within size classes, coalescing on free. Not thread-safe: one owner."""

    def __init__(self, capacity: int, granularity: int = 4096) -> None:
        if granularity <= 0 or granularity & (granularity - 1):
            raise ValueError("granularity must be a positive power of two")
        if capacity < granularity:
            raise ValueError(f"capacity {capacity} is below one granule ({granularity})")
        self.granularity = granularity
        self.capacity = capacity - capacity % granularity
        self._by_start: dict[int, int] = {}  # free extent start → size
        self._by_end: dict[int, int] = {}  # free extent end → start
        self._classes: list[dict[int, None]] = []  # ordered sets of free starts
        self._nonempty = 0  # bit k set when class k holds an extent
        self._allocated: dict[int, int] = {}  # offset → size
        self.used_bytes = 0
        self._insert_free(0, self.capacity)

    # ------------------------------------------------------------------ queries

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        if not self._nonempty:
            return 0
        top = self._classes[self._nonempty.bit_length() - 1]
        return max(self._by_start[start] for start in top)

    @property
    def fragmentation(self) -> float:
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    def rounded(self, size: int) -> int:
        return -(-size // self.granularity) * self.granularity

    def size_of(self, offset: int) -> int:
        try:
            return self._allocated[offset]
        except KeyError:
            raise ValueError(f"no extent is allocated at offset {offset}") from None

    def is_allocated(self, offset: int) -> bool:
        return offset in self._allocated

    def iter_free(self) -> Iterator[tuple[int, int]]:
        """Free extents as ``(offset, size)`` in offset order."""
        for start in sorted(self._by_start):
            yield start, self._by_start[start]

    def iter_allocated(self) -> Iterator[tuple[int, int]]:
        for start in sorted(self._allocated):
            yield start, self._allocated[start]

    # ------------------------------------------------------------------ allocate / free

    def allocate(self, size: int) -> int | None:
        """Reserve ``size`` bytes (rounded up); ``None`` when no free extent is big enough."""
        need = self._checked_size(size)
        if need > self.capacity:
            return None
        cls = self._class_of(need)
        if cls < len(self._classes):
            for start in self._classes[cls]:
                if self._by_start[start] >= need:
                    return self._take(start, need)
        above = self._nonempty >> (cls + 1)
        if not above:
            return None
        higher = cls + 1 + ((above & -above).bit_length() - 1)
        return self._take(next(iter(self._classes[higher])), need)

    def allocate_lowest(self, size: int, below: int | None = None) -> int | None:
        """Reserve ``size`` bytes at the lowest offset that fits, starting below ``below``.

        O(free extents): for compaction, not for the store path.
        """
        need = self._checked_size(size)
        limit = self.capacity if below is None else below
        best = None
        for start, extent in self._by_start.items():
            if extent >= need and start < limit and (best is None or start < best):
                best = start
        return None if best is None else self._take(best, need)

    def free(self, offset: int) -> None:
        size = self._allocated.pop(offset, None)
        if size is None:
            raise ValueError(f"no extent is allocated at offset {offset}")
        self.used_bytes -= size
        start, end = offset, offset + size
        before = self._by_end.get(start)
        if before is not None:
            self._remove_free(before)
            start = before
        after = self._by_start.get(end)
        if after is not None:
            end += after
            self._remove_free(offset + size)
        self._insert_free(start, end - start)

    # ------------------------------------------------------------------ internals

    def _checked_size(self, size: int) -> int:
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"extent size must be a positive integer, not {size!r}")
        return self.rounded(size)

    def _class_of(self, size: int) -> int:
        return (size // self.granularity).bit_length() - 1

    def _take(self, start: int, need: int) -> int:
        extent = self._remove_free(start)
        if extent > need:
            self._insert_free(start + need, extent - need)
        self._allocated[start] = need
        self.used_bytes += need
        return start

    def _insert_free(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        cls = self._class_of(size)
        while len(self._classes) <= cls:
            self._classes.append({})
        self._classes[cls][start] = None
        self._nonempty |= 1 << cls

    def _remove_free(self, start: int) -> int:
        size = self._by_start.pop(start)
        del self._by_end[start + size]
        cls = self._class_of(size)
        members = self._classes[cls]
        del members[start]
        if not members:
            self._nonempty &= ~(1 << cls)
        return size
