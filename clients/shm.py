"""The connection's two shared-memory windows, mapped in the client (daemon/server/windows.py).

``ClientWindows.open(fds)`` maps what HELLO_OK passed (``handshake.WindowFds``) and closes
the descriptors; ``OSError`` when the process cannot map them (the caller then uses the
inline path). Nothing here is reachable by path, and neither window holds another
connection's bytes: the daemon's host arena is never mapped by a client.

- ``put_window`` — read/write. ``allocate(nbytes)`` → offset or ``None`` (full), ``free(offset)``:
  the client places a payload here, then sends PUT with the offset; the daemon copies it
  into its own memory before digesting it, so the region is free again once PUT answers.
- ``load_window`` — a **read-only** mapping of a read-only descriptor: the kernel refuses
  to make it writable. The daemon copies a loaded payload into a region of it; the client
  copies it into its own destination and verifies it there (``copies.py``).
- ``close()`` — unmaps (deferred to garbage collection while a view is still exported).

No torch here: the copies live in ``copies.py``.
"""

from __future__ import annotations

import mmap
import threading

from statetier.protocol.extents import ExtentAllocator
from statetier.protocol.mappings import unmap

ALIGN = 64


class ClientWindows:
    """The put window (read/write, allocated here) and the load window (read-only)."""

    def __init__(self, put_map: mmap.mmap, load_map: mmap.mmap) -> None:
        self._put_map, self._load_map = put_map, load_map
        self.put_window = memoryview(put_map)
        self.load_window = memoryview(load_map).toreadonly()
        self._free = _FreeList(len(put_map))

    @classmethod
    def open(cls, fds) -> "ClientWindows":
        try:
            put = mmap.mmap(fds.put_fd, fds.put_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                load = mmap.mmap(fds.load_fd, fds.load_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
            except BaseException:
                put.close()
                raise
        finally:
            fds.close()
        return cls(put, load)

    def allocate(self, nbytes: int) -> int | None:
        return self._free.allocate(nbytes)

    def free(self, offset: int) -> None:
        self._free.free(offset)

    def close(self) -> None:
        # a tensor may still share a mapping: it is unmapped when that tensor is freed
        unmap((self.put_window, self.load_window), (self._put_map, self._load_map))


class _FreeList:
    """``ExtentAllocator`` (64-byte granules: first fit, coalescing) behind a lock: a blocking
    client's caller threads may put at once."""

    def __init__(self, capacity: int) -> None:
        self._extents = ExtentAllocator(capacity, ALIGN)
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int | None:
        with self._lock:
            return self._extents.allocate(max(nbytes, 1))

    def free(self, offset: int) -> None:
        with self._lock:
            self._extents.free(offset)
