"""The order a tier's eviction takes its objects in: one policy object behind one seam.

- ``EvictionPolicy`` — what a policy hears and answers: ``added(meta)`` (an object became
  visible), ``touched(object_id)`` (it was leased for a read), ``removed(object_id)`` (it
  left), ``order()`` (the objects, the first to evict first). ``LruIndex``
  (``tiers.ledger``) tells its policy of every change; the memory and disk tiers' removal
  parts walk ``order()`` when they evict (the Redis tier's order is a sorted set in Redis,
  shared by every node: ``tiers.redis.evict``).
- ``LruPolicy`` — least recently used first: the policy of every tier today. Another policy
  is a new class here (or a module beside it) handed to the ``Ledger``; no part changes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from .base import ObjectMeta


class EvictionPolicy(Protocol):
    def added(self, meta: ObjectMeta) -> None: ...

    def touched(self, object_id: bytes) -> None: ...

    def removed(self, object_id: bytes) -> None: ...

    def order(self) -> list[ObjectMeta]:
        """The objects it was told of, the first to evict first."""
        ...


class LruPolicy:
    """Least recently used first (added or touched last: evicted last)."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, ObjectMeta] = OrderedDict()

    def added(self, meta: ObjectMeta) -> None:
        self._order[meta.object_id] = meta
        self._order.move_to_end(meta.object_id)

    def touched(self, object_id: bytes) -> None:
        if object_id in self._order:
            self._order.move_to_end(object_id)

    def removed(self, object_id: bytes) -> None:
        self._order.pop(object_id, None)

    def order(self) -> list[ObjectMeta]:
        return list(self._order.values())
