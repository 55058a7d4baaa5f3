"""The daemon's host arena mapped into the client: the zero-copy path on one host.

``HostArena.open(path, size)`` maps the file that HELLO_OK's ``shm`` names, read/write.
The daemon hands out regions of it: a reservation (PUT_RESERVE → ``offset``) that the client
fills before PUT_COMMIT, and a leased payload (LOAD → ``offset``) that the client copies out
of before RELEASE. Outside those windows the client must not touch the arena.

- ``write_tensors(payload_offset, placements)`` — copy ``(tensor, offset)`` pairs into a
  reservation; GPU tensors are copied device → arena directly.
- ``read_tensors(payload_offset, placements, device)`` — fresh tensors from ``(spec, offset)``
  pairs of a leased payload.
- ``close()`` — unmaps (deferred to garbage collection while a view is still exported).

Copies are plain single-threaded torch copies (PERFORMANCE.md); the caller decides on
which thread they run. torch is imported here, so import this module lazily.
"""

from __future__ import annotations

import mmap
import os
from typing import Sequence

import torch

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import InvalidRequest, Unavailable

from .tensors import empty_for, tensor_bytes


class HostArena:
    """A read/write mapping of the daemon's host arena."""

    def __init__(self, path: str, mapping: mmap.mmap) -> None:
        self.path = path
        self._mmap = mapping
        self._view = memoryview(mapping)

    @classmethod
    def open(cls, path: str, size: int) -> "HostArena":
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise Unavailable(f"cannot open the daemon's shared memory {path!r}: {exc}") from exc
        try:
            if os.fstat(fd).st_size < size:
                raise Unavailable(f"shared memory {path!r} is smaller than the announced {size} bytes")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise Unavailable(f"cannot map the daemon's shared memory {path!r}: {exc}") from exc
        finally:
            os.close(fd)
        return cls(path, mapping)

    @property
    def size(self) -> int:
        return len(self._view)

    @property
    def view(self) -> memoryview:
        return self._view

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """A ``uint8`` tensor over ``nbytes`` arena bytes at ``offset`` (shares memory)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > len(self._view):
            raise InvalidRequest(f"arena region [{offset}, {offset + nbytes}) is outside the {self.size}-byte arena")
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        # torch keeps the object it is given, not a buffer export: hand it a slice, whose own
        # export keeps the mapping alive (and close() from unmapping it) while the tensor lives
        return torch.frombuffer(self._view[offset : offset + nbytes], dtype=torch.uint8)

    def write_tensors(self, payload_offset: int, placements: Sequence[tuple[torch.Tensor, int]]) -> None:
        for tensor, offset in placements:
            src = tensor_bytes(tensor)
            if src.numel():
                self.region(payload_offset + offset, src.numel()).copy_(src)

    def read_tensors(
        self,
        payload_offset: int,
        placements: Sequence[tuple[TensorSpec, int]],
        device: torch.device | str = "cpu",
    ) -> list[torch.Tensor]:
        out = []
        for spec, offset in placements:
            tensor = empty_for(spec, device)
            if spec.nbytes:
                tensor_bytes(tensor).copy_(self.region(payload_offset + offset, spec.nbytes))
            out.append(tensor)
        return out

    def close(self) -> None:
        try:
            self._view.release()
            self._mmap.close()
        except BufferError:
            pass  # a tensor still shares the mapping: it is unmapped when that tensor is freed
