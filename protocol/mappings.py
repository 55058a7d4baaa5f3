"""Letting go of a shared-memory window's mappings, on either end of the window protocol.

- ``unmap(views, mappings)`` — release each ``memoryview`` taken of a mapping, then close
  each ``mmap``. One still exported (a tensor or a copy job holds a view of it) is left to
  garbage collection: it is unmapped when that holder lets go, never under it.

Used by the daemon's per-connection windows (``daemon.server.windows``) and the client's
view of them (``clients.shm``). No system call beyond the unmapping itself.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable


def unmap(views: Iterable[memoryview], mappings: Iterable[mmap.mmap]) -> None:
    for view in views:
        try:
            view.release()
        except BufferError:
            pass
    for mapping in mappings:
        try:
            mapping.close()
        except BufferError:
            pass  # still exported: unmapped when its last holder lets go
