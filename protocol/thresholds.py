"""Measured sizes that decide where work runs: one place, for the daemon and the SDK alike.

- ``INLINE_WORK_BYTES`` — copies and digests of fewer bytes than this (a whole batch's,
  summed) run on the event loop; more go to an executor in one job. An executor hop cost
  ~26 µs of CPU and wall time on this 2-core machine (uvloop, a 2-thread pool, idle); copy +
  BLAKE3 of 256 KiB took ~29 µs (AVX-512; 7–9 GB/s): below it the hop costs more than the
  work it would move off the loop.
- ``PARALLEL_HASH_BYTES`` — BLAKE3 of a region at least this large runs on several threads
  (``max_threads=blake3.AUTO``). Measured (best of 15, warm buffers): 1 thread 10 GB/s at
  every size; AUTO 1.15× at 512 KiB, 1.37× at 1 MiB, 1.58× at 2 MiB, 1.8× at 4–8 MiB, and
  no gain at 16–32 MiB where both are bound by memory bandwidth. Below 1 MiB starting the
  threads costs most of what they save.

``run_work(executor, nbytes, fn)`` applies the first rule; ``protocol.digests`` the second.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Callable, TypeVar

from statetier.protocol.cancellation import wait_out_cancellation

INLINE_WORK_BYTES = 256 << 10
PARALLEL_HASH_BYTES = 1 << 20

T = TypeVar("T")


async def run_work(executor: Executor | None, nbytes: int, fn: Callable[[], T]) -> T:
    """``fn()`` on the loop below ``INLINE_WORK_BYTES`` (or without an executor), else as one
    executor job. A caller cancelled meanwhile is cancelled only once the job has ended:
    the job may be writing memory the caller frees when it unwinds."""
    if nbytes < INLINE_WORK_BYTES or executor is None:
        return fn()
    return await wait_out_cancellation(asyncio.get_running_loop().run_in_executor(executor, fn))
