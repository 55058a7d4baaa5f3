"""Moves as numbered cycles, so that a delete can wait for every move begun before it.

- ``MoveCycles`` — one per ``Placement``: ``cycle()`` (an ``async with`` around one move: an
  eviction and its demotions, a write-behind copy), ``begin()`` → an ``OpenCycle`` for a
  move whose end another object owns (a load's promotion: ``Promotion.complete`` ends it),
  ``has_moves`` (any cycle open), ``settle()`` (wait until every cycle begun before the
  call has ended: what ``daemon.engine.deletion`` does between its two sweeps).
- ``OpenCycle`` — one cycle under way; ``await end()`` closes it (once).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import AsyncIterator


class MoveCycles:
    """See the module docstring."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._open: set[int] = set()
        self._ended = asyncio.Condition()

    def begin(self) -> OpenCycle:
        cycle_id = next(self._ids)
        self._open.add(cycle_id)
        return OpenCycle(self, cycle_id)

    @contextlib.asynccontextmanager
    async def cycle(self) -> AsyncIterator[None]:
        opened = self.begin()
        try:
            yield
        finally:
            await opened.end()

    @property
    def has_moves(self) -> bool:
        return bool(self._open)

    async def settle(self) -> None:
        """Wait until every cycle that began before this call has ended."""
        cutoff = next(self._ids)
        async with self._ended:
            await self._ended.wait_for(lambda: not any(c < cutoff for c in self._open))

    async def _end(self, cycle_id: int) -> None:
        self._open.discard(cycle_id)
        async with self._ended:
            self._ended.notify_all()


class OpenCycle:
    """One cycle under way (``MoveCycles.begin``)."""

    __slots__ = ("_cycles", "_id")

    def __init__(self, cycles: MoveCycles, cycle_id: int) -> None:
        self._cycles, self._id = cycles, cycle_id

    async def end(self) -> None:
        await self._cycles._end(self._id)
