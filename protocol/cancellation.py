"""Waiting for work that a cancellation cannot stop.

- ``wait_out_cancellation(future)`` — await ``future`` (an asyncio future, or one wrapping an
  executor job); when the awaiting task is cancelled, keep waiting until ``future`` is done,
  then raise the ``CancelledError``. For a thread that still writes into a buffer the caller
  will free or reuse once the await ends: the disk tier reading straight into an arena
  reservation (``tiers.disk.load``), the client copying into a window region
  (``clients.transfers``). Further cancellations while it waits are absorbed; the future's
  own result or error is what a caller that was not cancelled gets.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

T = TypeVar("T")


async def wait_out_cancellation(future: asyncio.Future[T]) -> T:
    """See the module docstring."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                continue
        raise
