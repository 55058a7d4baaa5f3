"""A tier made of parts: each ``Tier`` call handed to the part that does it.

- ``ComposedTier(name, stores, loads, removal, eviction)`` — the ``Tier`` calls every tier
  family shares, each going to one part without an await of its own (the part's coroutine
  is returned as it is): ``prepare_store`` / ``write`` / ``complete_store`` to a
  ``StorePart``, ``prepare_load`` / ``read`` / ``complete_load`` / ``release_owner`` to a
  ``LoadPart``, ``delete`` to a ``RemovalPart``, ``evict`` to an ``EvictionPart``. ``HostTier`` and ``DeviceTier``
  (``tiers.memory.extent.ExtentTier``), ``DiskTier`` and ``RedisTier`` are one each; they
  add their lifecycle, their queries and what only they offer.
- ``IndexedTier(name, ledger, stores, loads, removal, eviction)`` — a ``ComposedTier`` whose
  ``Ledger`` index answers the queries in memory: ``contains``, ``get_meta``,
  ``find_by_keys``, ``iter_objects`` (the memory and disk tiers; Redis asks its medium).
  ``_require_open()`` is what a query checks first (nothing, unless a tier says otherwise).
- ``StorePart``, ``LoadPart``, ``RemovalPart``, ``EvictionPart`` — what those parts provide.

The parts share the tier's ``Ledger`` (``tiers.ledger``) and its medium, handed to each
when the tier builds them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol, Sequence

from .base import Buffer, EvictedObject, KeyMatches, Lease, ObjectMeta, StoreTicket, Tier
from .ledger import Ledger
from .registry import VersionRegistry


class StorePart(Protocol):
    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket: ...

    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None: ...

    async def complete_store(self, ticket: StoreTicket, success: bool) -> None: ...


class LoadPart(Protocol):
    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease: ...

    async def read(self, lease: Lease, *, into: memoryview | None = None, verify: bool = True) -> memoryview: ...

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

    def read(self, lease: Lease, *, into: memoryview | None = None,
             verify: bool = True) -> Coroutine[Any, Any, memoryview]:
        return self._load_part.read(lease, into=into, verify=verify)

    def complete_load(self, lease: Lease) -> Coroutine[Any, Any, None]:
        return self._load_part.complete_load(lease)

    def release_owner(self, owner: object) -> Coroutine[Any, Any, int]:
        return self._load_part.release_owner(owner)

    def delete(self, object_id: bytes) -> Coroutine[Any, Any, bool]:
        return self._removal_part.delete(object_id)

    def evict(self, need_bytes: int = 0) -> Coroutine[Any, Any, list[EvictedObject]]:
        return self._eviction_part.evict(need_bytes)


class IndexedTier(ComposedTier):
    """See the module docstring."""

    def __init__(self, name: str, ledger: Ledger[Any], stores: StorePart, loads: LoadPart, removal: RemovalPart,
                 eviction: EvictionPart) -> None:
        super().__init__(name, stores, loads, removal, eviction)
        self._ledger = ledger

    def _require_open(self) -> None:
        """Raise when the tier's medium cannot answer yet; a memory index always can."""

    async def contains(self, object_id: bytes) -> bool:
        return object_id in self._ledger.index

    async def get_meta(self, object_id: bytes) -> ObjectMeta | None:
        return self._ledger.index.get(object_id)

    async def find_by_keys(self, key_digests: Sequence[bytes],
                           registry: VersionRegistry | None = None) -> KeyMatches:
        self._require_open()
        return KeyMatches([self._ledger.index.by_key(digest) for digest in key_digests])

    async def iter_objects(self) -> AsyncIterator[ObjectMeta]:
        for meta in self._ledger.index.lru_order():
            if meta.object_id in self._ledger.index:
                yield meta
