"""Passes over payload bytes, counted: how many times each byte was copied and hashed.

- ``PASSES`` — this process's ``Passes``: ``copied`` and ``hashed`` byte totals, only ever
  growing (read two ``snapshot()`` values and subtract). ``protocol.digests`` counts every
  byte it hashes; the copies of payload bytes from one buffer into another count themselves
  through ``copy_into(dest, source)`` (the client's landing copy, the daemon's copies into
  its arena and windows, a Redis chunk into its reservation).
- ``Passes.per_byte(before, after, nbytes)`` → ``(copies, hashes)`` per byte of ``nbytes``.

Bytes moved by a socket or a file read are not passes here: they are the transfer itself,
which the raw paths (redis-py GET, pread) make too. What the daemon counted is published as
``statetier_payload_pass_bytes_total{op}`` (copied, hashed); ``statetier bench workloads``
prints it per side next to the raw path's count. Issue 25: each byte copied once per hop and
hashed once, where it lands.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PassCount:
    copied: int = 0
    hashed: int = 0


class Passes:
    """Byte totals of this process (see the module docstring); safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.copied = 0
        self.hashed = 0

    def count_copied(self, nbytes: int) -> None:
        with self._lock:
            self.copied += nbytes

    def count_hashed(self, nbytes: int) -> None:
        with self._lock:
            self.hashed += nbytes

    def snapshot(self) -> PassCount:
        with self._lock:
            return PassCount(self.copied, self.hashed)

    @staticmethod
    def per_byte(before: PassCount, after: PassCount, nbytes: int) -> tuple[float, float]:
        if nbytes <= 0:
            return 0.0, 0.0
        return (after.copied - before.copied) / nbytes, (after.hashed - before.hashed) / nbytes


PASSES = Passes()


def copy_into(dest: memoryview, source: bytes | bytearray | memoryview) -> None:
    """``dest[:] = source`` (the same size), counted as one copy of its bytes."""
    dest[:] = source
    PASSES.count_copied(dest.nbytes)


__all__ = ["PASSES", "PassCount", "Passes", "copy_into"]
