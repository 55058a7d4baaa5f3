"""A tier made of parts: each ``Tier`` call handed to the part that does it.

- ``ComposedTier(name, stores, loads, removal, eviction)`` — the ``Tier`` calls every tier
  family shares, each going to one part without an await of its own (the part's coroutine
  is returned as it is): ``prepare_store`` / ``write`` / ``complete_store`` to a
  ``StorePart``, ``prepare_load`` / ``read`` / ``complete_load`` / ``release_owner`` to a
  ``LoadPart``, ``delete`` to a ``RemovalPart``, ``evict`` to an ``EvictionPart``. ``HostTier`` and ``DeviceTier``
  (``tiers.memory.extent.ExtentTier``), ``DiskTier`` and ``RedisTier`` are one each; they
  add their lifecycle, their queries and what only they offer.
- ``StorePart``, ``LoadPart``, ``RemovalPart``, ``EvictionPart`` — what those parts provide.

The parts share the tier's ``Ledger`` (``tiers.ledger``) and its medium, handed to each
when the tier builds them.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol, Sequence

from .base import Buffer, EvictedObject, Lease, ObjectMeta, StoreTicket, Tier


class StorePart(Protocol):
    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket: ...

    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None: ...

    async def complete_store(self, ticket: StoreTicket, success: bool) -> None: ...


class LoadPart(Protocol):
    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease: ...

    async def read(self, lease: Lease) -> memoryview: ...

    async def complete_load(self, lease: Lease) -> None: ...

    async def release_owner(self, owner: object) -> int: ...


class RemovalPart(Protocol):
    async def delete(self, object_id: bytes) -> bool: ...


class EvictionPart(Protocol):
    async def evict(self, need_bytes: int = 0) -> list[EvictedObject]: ...


class ComposedTier(Tier):
    """See the module docstring."""

    def __init__(self, name: str, stores: StorePart, loads: LoadPart, removal: RemovalPart,
                 eviction: EvictionPart) -> None:
        self.name = name
        self._store_part, self._load_part = stores, loads
        self._removal_part, self._eviction_part = removal, eviction

    def prepare_store(self, meta: ObjectMeta) -> Coroutine[Any, Any, StoreTicket]:
        return self._store_part.prepare_store(meta)

    def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> Coroutine[Any, Any, None]:
        return self._store_part.write(ticket, chunks)

    def complete_store(self, ticket: StoreTicket, success: bool) -> Coroutine[Any, Any, None]:
        return self._store_part.complete_store(ticket, success)

    def prepare_load(self, object_id: bytes, owner: object = None,
                     ttl: float | None = None) -> Coroutine[Any, Any, Lease]:
        return self._load_part.prepare_load(object_id, owner, ttl)

    def read(self, lease: Lease) -> Coroutine[Any, Any, memoryview]:
        return self._load_part.read(lease)

    def complete_load(self, lease: Lease) -> Coroutine[Any, Any, None]:
        return self._load_part.complete_load(lease)

    def release_owner(self, owner: object) -> Coroutine[Any, Any, int]:
        return self._load_part.release_owner(owner)

    def delete(self, object_id: bytes) -> Coroutine[Any, Any, bool]:
        return self._removal_part.delete(object_id)

    def evict(self, need_bytes: int = 0) -> Coroutine[Any, Any, list[EvictedObject]]:
        return self._eviction_part.evict(need_bytes)
