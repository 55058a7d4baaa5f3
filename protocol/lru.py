"""The one bounded least-recently-used mapping, for every cache that must not grow.

- ``BoundedLru(capacity)`` — a mapping that keeps at most ``capacity`` entries, dropping the
  least recently used one when a ``put`` goes past it. ``get`` (a hit makes the entry the
  most recent), ``peek`` (no reordering), ``put``, ``pop``, ``discard``, ``clear``,
  ``items`` (a copy, oldest first), ``in`` and ``len``.

Who uses it: the version registry's heads and streams (``tiers.registry``), the Redis tier's
objects seen stored and manifests a lookup fetched, ``VerifiedHeaders`` (``protocol.sealed``),
the engine's state_id → stream and stream → newest version seen (``daemon.engine.fencing``)
and the client's parsed headers (``protocol.sealed.ParsedHeaders``). Safe to share between the event loop
and executor threads: each call holds a lock for a few dictionary operations.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLru(Generic[K, V]):
    """See the module docstring."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a bounded LRU needs a capacity of at least 1, not {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        """The value (now the most recently used), or None."""
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def peek(self, key: K) -> V | None:
        """The value, leaving the order as it is; or None."""
        return self._items.get(key)

    def put(self, key: K, value: V) -> None:
        """Store ``value`` as the most recently used; the oldest entry goes past capacity."""
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            if len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def pop(self, key: K) -> V | None:
        """Remove and return the value, or None."""
        with self._lock:
            return self._items.pop(key, None)

    def discard(self, key: K) -> None:
        with self._lock:
            self._items.pop(key, None)

    def items(self) -> list[tuple[K, V]]:
        with self._lock:
            return list(self._items.items())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
