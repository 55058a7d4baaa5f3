"""Per-connection shared-memory windows: the zero-copy path without a shared arena.

A same-host client that asks for shared memory at HELLO gets two ``memfd`` windows of its
own, passed over the Unix socket with ``SCM_RIGHTS`` (nothing is reachable by path, and a
worker outside the daemon's group can map them):

- the **put window**, read/write for both sides: the client allocates in it, copies a
  payload there (hashing it as it copies) and sends ``PUT`` with its offset and the
  regions' digests; the daemon copies the bytes into memory only it can write and seals
  over those digests, so a worker that changes them afterwards changes nothing stored (and
  bytes its digests do not describe make an object every load refuses: docs/protocol.md §6.1);
- the **load window**, written by the daemon and passed to the client as a read-only file
  descriptor (a read/write mapping of it is refused by the kernel): the daemon allocates a
  region, copies a leased payload there and names the region in the LOAD reply; the client
  copies it into its own destination, verifies it there against the signed header's
  digests, and gives the region back (``RELEASE`` with ``regions``).

The daemon's host arena is never mapped by a client, so no worker sees another tenant's
bytes, or another connection's.

- ``Windows.open(put_bytes, load_bytes)`` — creates and maps both; ``fds_for_client()``
  the two descriptors to send (put read/write, load read-only); ``close()``.
- ``put_view(offset, nbytes)`` — the bytes a client says it wrote (bounds checked).
- ``place(payload)`` → ``(region_id, offset)`` or ``None`` when the window has no room;
  ``free(region_id)``; ``regions_in_use``; ``free_bytes``.
- ``step_bytes(sizes)`` — how much of the load window one reply of payloads of ``sizes``
  may take: all of it when they fit what is free, else half the window, so that a
  batch larger than the window streams through it pipelined (the next step is placed in
  the other half while the client copies and verifies this one).
"""

from __future__ import annotations

import fcntl
import mmap
import os

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.extents import ExtentAllocator
from statetier.protocol.mappings import unmap

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
GRANULE = 4096


def _memfd(label: str, size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        # the client holds the fd: it must not be able to shrink the window under the daemon
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


def _reopen_read_only(fd: int) -> int:
    """A new open file description of ``fd``'s file, read-only: a mapping of it can never
    be made writable (``mmap``/``mprotect`` with ``PROT_WRITE`` fail with ``EACCES``)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


class Windows:
    """The two windows of one connection; see the module docstring. One owner (the loop)."""

    def __init__(self, put: tuple[int, mmap.mmap], load: tuple[int, mmap.mmap], load_ro_fd: int) -> None:
        self._put_fd, self._put_map = put
        self._load_fd, self._load_map = load
        self._load_ro_fd = load_ro_fd
        self._put_view = memoryview(self._put_map)
        self._load_view = memoryview(self._load_map)
        self._allocator = ExtentAllocator(len(self._load_map), GRANULE)
        self._regions: dict[int, int] = {}  # region id -> offset
        self._next_id = 1

    @classmethod
    def open(cls, put_bytes: int, load_bytes: int) -> "Windows":
        """Both windows; ``OSError`` where memfds or ``/proc`` are unusable (no shm then)."""
        put = _memfd("statetier-put-window", put_bytes)
        try:
            load = _memfd("statetier-load-window", load_bytes)
            try:
                read_only = _reopen_read_only(load[0])
            except BaseException:
                load[1].close()
                os.close(load[0])
                raise
        except BaseException:
            put[1].close()
            os.close(put[0])
            raise
        return cls(put, load, read_only)

    @property
    def put_bytes(self) -> int:
        return len(self._put_view)

    @property
    def load_bytes(self) -> int:
        return len(self._load_view)

    def fds_for_client(self) -> list[int]:
        return [self._put_fd, self._load_ro_fd]

    def hello(self) -> dict:
        """What HELLO_OK says about the windows (their descriptors travel beside it)."""
        return {"put_bytes": self.put_bytes, "load_bytes": self.load_bytes}

    # -- put window ----------------------------------------------------------------------

    def put_view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.put_bytes:
            raise InvalidRequest(f"put window range [{offset}, {offset + nbytes}) is outside the "
                                 f"{self.put_bytes}-byte window")
        return self._put_view[offset : offset + nbytes]

    # -- load window ---------------------------------------------------------------------

    def place(self, nbytes: int) -> tuple[int, int, memoryview] | None:
        """A region of ``nbytes`` in the load window: (region id, offset, writable view)."""
        offset = self._allocator.allocate(max(nbytes, 1))
        if offset is None:
            return None
        region_id = self._next_id
        self._next_id += 1
        self._regions[region_id] = offset
        return region_id, offset, self._load_view[offset : offset + nbytes]

    def free(self, region_id: int) -> bool:
        offset = self._regions.pop(region_id, None)
        if offset is None:
            return False
        self._allocator.free(offset)
        return True

    @property
    def free_bytes(self) -> int:
        return self._allocator.free_bytes

    def step_bytes(self, sizes: list[int]) -> int:
        """The load-window bytes one reply of payloads of ``sizes`` may take (see above)."""
        if sum(self._allocator.rounded(max(n, 1)) for n in sizes) <= self._allocator.free_bytes:
            return self.load_bytes
        return self.load_bytes // 2

    @property
    def regions_in_use(self) -> int:
        return len(self._regions)

    def close(self) -> None:
        self._regions.clear()
        unmap((self._put_view, self._load_view), (self._put_map, self._load_map))  # a copy job may hold a view
        for fd in (self._put_fd, self._load_fd, self._load_ro_fd):
            os.close(fd)
