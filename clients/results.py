"""Memory for the tensors a load allocates: recycled, so a large result does not fault page by page.

- ``ResultPool()`` — one per client connection's ``Transfers``; nothing is mapped until the
  first large result. ``empty(spec, device)`` — an uninitialised tensor of ``spec``: a CPU
  tensor of ``thresholds.RECYCLED_BUFFER_BYTES`` or more lies in a private anonymous mapping
  the pool recycles (``protocol.recycled.RecycledMemory``), anything else is
  ``torch.empty``. ``kept_bytes``, ``handed_out``.

A fresh 32 MiB ``torch.empty`` is an ``mmap`` of its own (glibc's threshold), so the copy into
it takes one minor fault per 4 KiB page (8,193 measured) and ``free`` unmaps it again: each
allocating load paid the faults anew (2.2× a load into a caller's buffer at 32 MiB, issue 33).
Huge pages do not help where the kernel hands out none (``AnonHugePages`` stayed 0 here with
``MADV_HUGEPAGE``), and pre-faulting (``MADV_POPULATE_WRITE``) costs more than the faults.
So the pool keeps the memory: the tensor is built over a ``ctypes`` array at the mapping's
address (``torch.frombuffer``), and when the last tensor over it (a view, a slice) is gone
the array's finalizer gives the mapping back to the pool, already faulted in, for the next
result of that size. At most ``KEEP_BYTES`` are kept; past it a freed mapping is unmapped.
The SDK changes no allocator setting of the host process (PERFORMANCE.md).
"""

from __future__ import annotations

import torch

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.recycled import RecycledMemory
from statetier.protocol.thresholds import RECYCLED_BUFFER_BYTES

from .tensors import empty_for, torch_dtype

KEEP_BYTES = 512 << 20  # freed result memory kept for reuse, at most (the 8 × 32 MiB batch twice)


class ResultPool:
    """See the module docstring. Safe from any thread (finalizers run where a tensor dies)."""

    def __init__(self) -> None:
        self._memory = RecycledMemory(KEEP_BYTES)

    @property
    def kept_bytes(self) -> int:
        return self._memory.kept_bytes

    @property
    def handed_out(self) -> int:
        return self._memory.handed_out

    def empty(self, spec: TensorSpec, device: torch.device | str | None = None) -> torch.Tensor:
        """An uninitialised tensor of ``spec`` on ``device`` (pooled memory when large, on CPU)."""
        nbytes, dtype = spec.nbytes, torch_dtype(spec.dtype)
        numel = 1
        for dim in spec.shape:
            numel *= dim
        if (nbytes < RECYCLED_BUFFER_BYTES or torch.device(device or "cpu").type != "cpu"
                or numel * dtype.itemsize != nbytes):  # a packed sub-byte dtype: torch lays it out
            return empty_for(spec, device)
        flat = torch.frombuffer(self._memory.array(nbytes), dtype=torch.uint8)  # holds the array
        return flat.view(dtype).view(tuple(spec.shape))

    def clear(self) -> None:
        """Unmap what is kept (the tensors handed out keep their mappings until they are gone)."""
        self._memory.clear()
