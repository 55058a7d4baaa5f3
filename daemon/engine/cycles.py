"""Moves as numbered cycles, so that a delete can wait for every move begun before it.

- ``MoveCycles`` — one per ``Placement``: ``cycle()`` (an ``async with`` around one move: an
  eviction and its demotions, a write-behind copy), ``begin()`` → an ``OpenCycle`` for a
  move whose end another object owns (a load's promotion: ``Promotion.complete`` ends it),
  ``has_moves`` (any cycle open), ``settle()`` (wait until every cycle begun before the
  call has ended: what ``daemon.engine.deletion`` does between its two sweeps).
  ``begin_promotion()`` opens the cycle of a load's promotion, which never takes a copy
  away from where it was: ``has_relocations`` and ``settle_relocations()`` leave those out
  (a load that found its object in no tier waits for what may hold it between two tiers,
  never for the promotions its own batch holds open: ``daemon.engine.pulls``).
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
        self._promotions: set[int] = set()
        self._ended = asyncio.Condition()

    def begin(self) -> OpenCycle:
        cycle_id = next(self._ids)
        self._open.add(cycle_id)
        return OpenCycle(self, cycle_id)

    def begin_promotion(self) -> OpenCycle:
        opened = self.begin()
        self._promotions.add(opened._id)
        return opened

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

    @property
    def has_relocations(self) -> bool:
        return len(self._open) > len(self._promotions)

    async def settle_relocations(self) -> None:
        """Wait until every cycle but the promotions that began before this call has ended."""
        cutoff = next(self._ids)
        async with self._ended:
            await self._ended.wait_for(lambda: not any(c < cutoff and c not in self._promotions for c in self._open))

    async def _end(self, cycle_id: int) -> None:
        self._open.discard(cycle_id)
        self._promotions.discard(cycle_id)
        async with self._ended:
            self._ended.notify_all()


class OpenCycle:
    """One cycle under way (``MoveCycles.begin``)."""

    __slots__ = ("_cycles", "_id")

    def __init__(self, cycles: MoveCycles, cycle_id: int) -> None:
        self._cycles, self._id = cycles, cycle_id

    async def end(self) -> None:
        await self._cycles._end(self._id)
