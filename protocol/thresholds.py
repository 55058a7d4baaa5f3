"""Measured sizes that decide where work runs: one place, for the daemon and the SDK alike.

- ``INLINE_WORK_BYTES`` — a job that *hashes* fewer bytes than this (a whole batch's,
  summed) runs on the event loop; one that hashes more goes to an executor, in one job.
  Plain copies do not count: a memoryview copy holds the GIL wherever it runs, so moving
  it to a thread frees the loop for nothing and adds the hop. BLAKE3 releases the GIL, so
  off the loop a hash runs beside it. Measured on this 2-core machine (AVX-512, uvloop,
  a 2-thread pool; medians, load 6): the hop 24–33 µs; BLAKE3 of 256 KiB 29 µs (one
  thread); a copy of 2 MiB 46 µs (97 µs for 4 MiB, 3.2 ms for 32 MiB); a thread spinning
  beside a memoryview copy of 64 MiB got 0 iterations (beside BLAKE3 of the same bytes:
  210k–375k; beside ``numpy.copyto``: ~50k). Round 1 counted copies as digests: a 2 MiB
  put's window fill then took 240 µs through the hop (load 5.8), and the 2 MiB rows' ratios
  fell from 0.32/0.45 to 0.22/0.27.
- ``PARALLEL_HASH_BYTES`` — BLAKE3 of a region at least this large runs on several threads
  (``max_threads=blake3.AUTO``). Measured (best of 15, warm buffers, idle): 1 thread 10 GB/s
  at every size; AUTO 1.15× at 512 KiB, 1.37× at 1 MiB, 1.58× at 2 MiB, 1.8× at 4–8 MiB,
  and no gain at 16–32 MiB where both are bound by memory bandwidth. Below 1 MiB starting
  the threads costs most of what they save.

- ``INLINE_COPY_BYTES`` — a plain copy *between memory regions by address* (the memory
  tiers' extents: ``ctypes.memmove`` in an executor thread releases the GIL, where a
  memoryview slice assignment on the loop does not) runs on the loop up to this size, in the
  executor above it: a thread hop costs about as much as copying 512 KiB. The memory tiers'
  ``inline_copy_bytes`` default.

- ``RECYCLED_BUFFER_BYTES`` — a buffer of at least this many bytes lies in memory that is
  recycled already faulted in (``protocol.recycled``), below it a fresh allocation: a CPU
  tensor a load allocates (``clients.results.ResultPool``, else ``torch.empty``), the body a
  frame is received into and the data of the daemon's inline load replies (else a
  ``bytearray``). For frames, measured (8 × 2 MiB inline loads, two 8 MiB replies in flight,
  counted with ``getrusage``, load 0.6): 4,124 minor faults and 15.3 ms of system time per call in
  the client with fresh ``bytearray`` bodies, none with recycled ones. For results,
  measured (this machine, AVX-512, load 3.6, median of 15, a fresh destination + copy as a
  ratio to a copy into a warm buffer): ``torch.empty`` 2.9–24× at 2–4 MiB (glibc maps each
  of these afresh until its dynamic threshold has grown), 2.5–3.6× at 8 MiB, 5.4× at 32 MiB
  (8,193 minor faults); an ``mmap`` with ``MADV_HUGEPAGE`` 7–31× (the kernel gave no huge
  page: ``AnonHugePages`` 0, 8,192 faults); a recycled mapping 0 faults. From 1 MiB a
  result is an ``mmap`` of glibc's anyway, so recycling it costs nothing glibc did not.

``run_work(executor, hashed, fn)`` applies the first rule (``hashed``: the bytes ``fn``
digests); ``protocol.digests`` the second.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Callable, TypeVar

from statetier.protocol.cancellation import wait_out_cancellation

INLINE_WORK_BYTES = 256 << 10
INLINE_COPY_BYTES = 512 << 10
PARALLEL_HASH_BYTES = 1 << 20
RECYCLED_BUFFER_BYTES = 1 << 20

T = TypeVar("T")


def runs_inline(executor: Executor | None, hashed: int) -> bool:
    """Whether a job that digests ``hashed`` bytes runs on the loop (the rule above)."""
    return hashed < INLINE_WORK_BYTES or executor is None


async def run_work(executor: Executor | None, hashed: int, fn: Callable[[], T]) -> T:
    """``fn()`` on the loop when it digests fewer than ``INLINE_WORK_BYTES`` (plain copies
    never count), or without an executor; else as one executor job. A caller cancelled
    meanwhile is cancelled only once the job has ended: the job may be writing memory the
    caller frees when it unwinds."""
    if runs_inline(executor, hashed):
        return fn()
    return await wait_out_cancellation(asyncio.get_running_loop().run_in_executor(executor, fn))
