"""Large buffers that are recycled, already faulted in, once nothing uses them any more.

- ``RecycledMemory(keep_bytes)`` — anonymous mappings in size classes (a page multiple,
  rounded up to the next eighth of its power of two: at most 12.5 % more than asked).
  ``array(nbytes)`` — a ``ctypes`` array of ``nbytes`` over one of them (for
  ``torch.frombuffer``); ``view(nbytes)`` — a writable ``memoryview`` (format ``B``) over
  one. Neither is zeroed: a recycled one holds what its last user left. When the last
  reference to the array is gone (every view, slice and tensor over it), a finalizer gives
  the mapping back for the next request of its class; at most ``keep_bytes`` are kept,
  past that a freed mapping is unmapped. ``kept_bytes``, ``handed_out``. Safe from any
  thread (finalizers run where the last reference dies).
- ``FRAME_MEMORY`` — the process's pool for frame buffers of ``thresholds.RECYCLED_BUFFER_BYTES``
  or more: the body a ``FrameDecoder`` receives a large frame into, the data of the
  daemon's inline replies.

Why: a fresh buffer of a megabyte or more is an ``mmap`` of glibc's (or comes from a heap top
glibc trims again as soon as two such buffers were freed together), so filling it takes a
minor fault per 4 KiB page, and ``bytearray(n)`` zeroes it first. With two inline 8 MiB load
replies in flight a client took 4,124 faults and 15 ms of system time per 8 × 2 MiB call
(issue 33's inline regression); a recycled mapping takes none.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref

from statetier.protocol.thresholds import RECYCLED_BUFFER_BYTES

_PAGE = mmap.PAGESIZE


def size_class(nbytes: int) -> int:
    """The mapping size that serves a request of ``nbytes``: pages, rounded up to an eighth
    of the power of two below it."""
    size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    step = max(_PAGE, (1 << (size.bit_length() - 1)) >> 3)
    return -(-size // step) * step


class RecycledMemory:
    """See the module docstring."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}  # size class -> mappings free for reuse
        self.kept_bytes = 0
        self.handed_out = 0

    def array(self, nbytes: int) -> "ctypes.Array[ctypes.c_uint8]":
        """A ``ctypes`` array of ``nbytes`` unsigned bytes over recycled memory (not zeroed)."""
        size = size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            mapping = free.pop() if free else None
            if mapping is not None:
                self.kept_bytes -= size
            self.handed_out += 1
        if mapping is None:
            mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        anchor = ctypes.c_char.from_buffer(mapping)  # the address only: released right after
        array = (ctypes.c_uint8 * nbytes).from_address(ctypes.addressof(anchor))
        del anchor
        weakref.finalize(array, self._give_back, mapping, size)
        return array

    def view(self, nbytes: int) -> memoryview:
        """A writable byte view of ``nbytes`` over recycled memory (not zeroed); it and its
        slices keep the memory from being handed out again."""
        return memoryview(self.array(nbytes)).cast("B")

    def _give_back(self, mapping: mmap.mmap, size: int) -> None:
        with self._lock:
            self.handed_out -= 1
            if self.kept_bytes + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(mapping)
                self.kept_bytes += size
                return
        mapping.close()  # nothing points into it any more: the array was the last thing

    def clear(self) -> None:
        """Unmap what is kept (what is handed out keeps its mapping until it is gone)."""
        with self._lock:
            kept, self._free, self.kept_bytes = self._free, {}, 0
        for mappings in kept.values():
            for mapping in mappings:
                mapping.close()


def frame_buffer(nbytes: int) -> bytearray | memoryview:
    """A writable buffer of ``nbytes`` for a frame's body or data: recycled from
    ``FRAME_MEMORY`` from ``RECYCLED_BUFFER_BYTES`` on (not zeroed), else a ``bytearray``."""
    if nbytes >= RECYCLED_BUFFER_BYTES:
        return FRAME_MEMORY.view(nbytes)
    return bytearray(nbytes)


#: Two of the largest default frames in flight, and their replies' data beside them.
FRAME_MEMORY = RecycledMemory(keep_bytes=192 << 20)

__all__ = ["FRAME_MEMORY", "RecycledMemory", "frame_buffer", "size_class"]
