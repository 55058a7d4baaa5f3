"""How objects leave an extent tier: ``delete`` and LRU eviction down to the low watermark.

- ``ExtentRemoval(ledger, region, loads, capacity, high_watermark, low_watermark)`` —
  ``delete`` / ``evict`` / ``evict_sparing_copies`` of ``ExtentTier`` (``tiers.memory.extent``), called
  by the daemon's deletes and its capacity loop.

A delete under a lease hides the object (``Ledger.hide``): its extent is freed when the
last lease ends. Eviction is exact LRU over unleased objects; their bytes are copied out
first (so the caller can demote them), except those a lower tier already holds, and a
victim loaded or deleted while its bytes were copied out stays (or is gone).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from ..base import EvictedObject, ObjectMeta
from ..ledger import Ledger
from .loads import ExtentLoads
from .records import ObjectExtent
from .region import ExtentRegion


class ExtentRemoval:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[ObjectExtent], region: ExtentRegion, loads: ExtentLoads, capacity: int,
                 high_watermark: float, low_watermark: float) -> None:
        self._ledger = ledger
        self._region = region
        self._loads = loads
        self._capacity, self._high, self._low = capacity, high_watermark, low_watermark

    async def delete(self, object_id: bytes) -> bool:
        space = self._region.space
        place = space.places.pop(object_id, None)
        meta = self._ledger.index.remove(object_id)
        if place is None or meta is None:
            return False
        if self._ledger.leases.is_leased(object_id):
            self._ledger.hide(meta, place)
        else:
            space.free(place.offset)
        return True

    async def evict(self, need_bytes: int = 0) -> list[EvictedObject]:
        return await self.evict_sparing_copies(need_bytes, None)

    async def evict_sparing_copies(self, need_bytes: int,
                                   is_held_below: Callable[[bytes], Awaitable[bool]] | None) -> list[EvictedObject]:
        space = self._region.space
        self._loads.expire_leases()
        used = self._ledger.bytes_used
        if used + need_bytes <= self._high * self._capacity:
            return []
        excess = used + need_bytes - self._low * self._capacity
        victims: list[tuple[ObjectMeta, ObjectExtent, int]] = []
        chosen = 0
        for meta in self._ledger.index.lru_order():
            if chosen >= excess:
                break
            if not self._ledger.leases.is_leased(meta.object_id):
                place = space.places[meta.object_id]
                victims.append((meta, place, place.touched))
                chosen += meta.size
        if not victims:
            return []
        # a victim with a copy below leaves without its bytes being copied out (the copy is
        # what a write-behind already made: copying it out again only to drop it cost a
        # whole watermark band of memcpy per eviction)
        spared = [is_held_below is not None and await is_held_below(meta.object_id) for meta, _, _ in victims]
        copied = await space.bytes.copy_out([place for (_, place, _), kept in zip(victims, spared) if not kept])
        blobs = iter(copied)
        evicted = []
        for (meta, place, touched), kept in zip(victims, spared):
            blob = None if kept else next(blobs)
            oid = meta.object_id
            if space.places.get(oid) is not place or place.touched != touched or self._ledger.leases.is_leased(oid):
                continue  # loaded or deleted while its bytes were copied out: it stays (or is gone)
            del space.places[oid]
            self._ledger.index.remove(oid)
            space.free(place.offset)
            evicted.append(EvictedObject(meta, blob))
        self._ledger.evictions += len(evicted)
        return evicted
