"""Raw memory for the extent tiers: buffer addresses and copies that release the GIL.

- ``exported(obj)``     — context manager: the address and length of any C-contiguous
                          buffer (``bytes`` included), held exported until exit;
                          ``exported_for_write(obj)`` also insists that it is writable.
- ``copy_bytes(dst, src, n)`` — ``memmove`` between addresses; releases the GIL, so an
                          executor thread copies while the event loop keeps running.
- ``view_at(address, n)`` — a writable ``memoryview`` over memory owned elsewhere (a
                          torch tensor); the caller keeps the owner alive.
- ``byte_view(buffer)``  — a flat, contiguous ``B`` view of any buffer (a copy if it is not
                          contiguous); ``release_quietly(view)`` drops our reference to one.
- ``fresh_buffer(n)``   — an anonymous mapping to copy an evicted object into: its pages
                          are zeroed on first touch by the kernel, not by a ``memset``.

``memoryview`` slice assignment is as fast, but holds the GIL for the whole copy; the
tiers use it below ``inline_copy_bytes`` and these helpers above.
"""

from __future__ import annotations

import ctypes
import mmap
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator

from ..base import Buffer


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (stable ABI since 3.11, unchanged since 3.3)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_PyBUF_SIMPLE = 0
_PyBUF_WRITABLE = 1
_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None


@contextmanager
def _exported(obj: object, flags: int) -> Iterator[tuple[int, int]]:
    view = _PyBuffer()
    _get_buffer(obj, ctypes.byref(view), flags)
    try:
        yield (view.buf or 0), view.len
    finally:
        _release_buffer(ctypes.byref(view))


def exported(obj: object) -> AbstractContextManager[tuple[int, int]]:
    """``(address, nbytes)`` of ``obj``'s bytes; raises ``BufferError`` if not contiguous.

    While inside, the exporter cannot resize or free the memory (a ``bytearray`` refuses
    to grow, an ``mmap`` to close), so a thread may copy from it safely.
    """
    return _exported(obj, _PyBUF_SIMPLE)


def exported_for_write(obj: object) -> AbstractContextManager[tuple[int, int]]:
    """Like ``exported``, for a destination: raises ``BufferError`` if ``obj`` is read-only."""
    return _exported(obj, _PyBUF_WRITABLE)


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    if nbytes:
        ctypes.memmove(dst, src, nbytes)


def view_at(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def fresh_buffer(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]


def address_of(buffer: mmap.mmap | memoryview | bytearray) -> int:
    """The address of a writable buffer; the export ends before this returns."""
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def byte_view(chunk: Buffer) -> memoryview:
    """A flat, contiguous ``B`` view of any buffer (non-contiguous ones are copied)."""
    view = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def release_quietly(view: memoryview | None) -> None:
    """Release our reference; a view still exported elsewhere lives on until that ends."""
    if view is not None:
        try:
            view.release()
        except BufferError:
            pass
