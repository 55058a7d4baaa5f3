"""The cluster's purge marks, honoured before a load or a lookup is served (DESIGN §5).

A purge on one daemon writes a mark (scope → cutoff) into the shared registry
(``catalog.purge``); every other daemon must stop serving what it names from the next load or
lookup on, not from its next health probe. ``PurgeMarks(read, honour)`` — one per engine whose
shared tier keeps marks (``stack.publishing.marks``, a ``tiers.base.PurgeMarkStore``):

- ``await before_serving()`` — reads the marks (one small round trip) and, when one is new
  (made since this daemon last honoured it), removes this daemon's copies it names
  (``honour``: one walk of its own tiers, ``catalog.honour_marks``) before the caller locates
  anything: a load or lookup that starts after another daemon's purge returned never finds
  what it purged. With the shared registry unreachable the marks known are the answer (the
  outage rule: copies this daemon holds are served).
- ``await take(marks)`` — the same for marks read elsewhere: a lookup's own round trip to the
  shared tier brings them (``KeyMatches.purge_marks``, ``candidates.locate_many``), and the
  health probe's tick; whether a new one was honoured (what was located must be again).

Concurrent callers share one honour of a new mark (a lock).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from statetier.protocol.errors import Unavailable


class PurgeMarks:
    def __init__(self, read: Callable[[], Awaitable[dict[str, int]]],
                 honour: Callable[[dict[str, int]], Awaitable[object]]) -> None:
        self._read, self._honour = read, honour
        self._known: dict[str, int] = {}  # scope -> the cutoff honoured
        self._lock = asyncio.Lock()

    async def before_serving(self) -> None:
        try:
            marks = await self._read()
        except Unavailable:
            return  # the outage rule: what this daemon holds is served, counted by the engine
        await self.take(marks)

    async def take(self, marks: dict[str, int]) -> bool:
        if not self._fresh(marks):
            return False
        async with self._lock:
            fresh = self._fresh(marks)  # another caller may have honoured them meanwhile
            if fresh:
                await self._honour(fresh)
                self._known.update(fresh)
        return True

    def _fresh(self, marks: dict[str, int]) -> dict[str, int]:
        return {scope: cutoff for scope, cutoff in marks.items() if self._known.get(scope) != cutoff}
