"""How a batch call is cut into batch frames, and how an item's error names its place.

- ``batches_of(items, max_bytes, size_of)`` → consecutive runs of at most ``BATCH_ITEMS``
  items and ``max_bytes`` (by ``size_of(item)``; a bigger item goes alone), in order.
- ``pairs_bytes(pairs)`` — the payload bytes of a put's ``[(name, tensor)]`` (an upper bound:
  each tensor's bytes plus its alignment padding).
- ``with items_from(offset):`` — a batch item's error (``detail["item"]``, its position in
  its frame) is shifted by ``offset`` to its position in the whole call.
- ``load_batch_items(count)`` — how many targets of a ``load_many`` of ``count`` go in one
  frame: the call is cut into about ``LOAD_PIPELINE`` frames so that the daemon reads the
  next frame's objects while this process copies and verifies the last one's.
- ``in_order(calls, depth)`` — await the calls with at most ``depth`` in flight; the results
  in order, or the first (by position) error with the calls after it cancelled.

Used by ``AsyncClient.put_many`` / ``load_many``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable

from statetier.protocol.errors import StatetierError

BATCH_ITEMS = 64
# A load_many is cut into about this many frames, two in flight: the daemon's reads (disk,
# Redis, the window copy) of one frame overlap this process's copy and hash of the other's.
# A put_many keeps one frame at a time: the versions of one stream must be claimed in order,
# and a frame sent beside an earlier one could claim a later version first (StaleState).
LOAD_PIPELINE = 4
LOAD_IN_FLIGHT = 2
MIN_LOAD_BATCH = 4  # fewer items per frame cost more in round trips than the overlap gives


def load_batch_items(count: int) -> int:
    return max(MIN_LOAD_BATCH, min(BATCH_ITEMS, -(-count // LOAD_PIPELINE)))


def batches_of(items: list, max_bytes: int, size_of, max_items: int = BATCH_ITEMS) -> list[list]:
    """Consecutive runs of at most ``max_items`` items and ``max_bytes`` (a bigger item
    goes alone)."""
    batches: list[list] = []
    current: list = []
    nbytes = 0
    for item in items:
        size = size_of(item)
        if current and (len(current) >= max_items or nbytes + size > max_bytes):
            batches.append(current)
            current, nbytes = [], 0
        current.append(item)
        nbytes += size
    if current:
        batches.append(current)
    return batches


def pairs_bytes(pairs) -> int:
    return sum(t.numel() * t.element_size() + 64 for _, t in pairs)


@contextlib.contextmanager
def items_from(offset: int):
    """A batch item's error names its position in the whole call, not in its frame."""
    try:
        yield
    except StatetierError as exc:
        item = exc.detail.get("item")
        if isinstance(item, int):
            exc.detail["item"] = item + offset
        raise


async def in_order(calls: list[Callable[[], Awaitable]], depth: int) -> list:
    """Run ``calls`` with at most ``depth`` in flight and return their results in order. The
    first call (by position) that fails ends it: the calls after it are cancelled (and
    awaited) and its error is raised, as a caller awaiting them one by one would see it."""
    gate = asyncio.Semaphore(depth)

    async def gated(call):
        async with gate:
            return await call()

    tasks = [asyncio.ensure_future(gated(call)) for call in calls]
    try:
        return [await task for task in tasks]
    finally:
        late = [task for task in tasks if not task.done()]
        for task in late:
            task.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)
