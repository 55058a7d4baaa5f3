"""How objects leave the disk tier: ``delete``, damaged copies dropped, LRU eviction.

- ``DiskRemoval(ledger, volume)`` — ``delete`` / ``evict`` of ``DiskTier``
  (``tiers.disk.tier``); ``remove_nowait`` (the object invisible now, its index entry in the
  next commit) and ``drop_corrupt`` serve the other parts and compaction; ``settle`` forgets
  the objects deleted under a lease whose last lease ended.

A delete under a lease hides the object (``Ledger.hide``) and marks it lingering in its
segment, so compaction keeps the file while a reader may still be in it. ``evict`` removes
LRU objects down to the low watermark, but past what brings usage under the high one at most
``eviction_batch_bytes`` per call: their bytes are read into memory for the tier below.
"""

from __future__ import annotations

import asyncio

from statetier.protocol.classify import is_damage
from statetier.protocol.errors import RejectedState

from ..base import EvictedObject, ObjectMeta
from ..ledger import Ledger
from .index import Delete, Location
from .volume import DiskVolume


class DiskRemoval:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[Location], volume: DiskVolume) -> None:
        self._ledger = ledger
        self._volume = volume

    async def delete(self, object_id: bytes) -> bool:
        self._volume.require_started()
        done = self.remove_nowait(object_id)
        if done is None:
            return False
        await asyncio.shield(done)
        return True

    def remove_nowait(self, object_id: bytes) -> asyncio.Future[object] | None:
        """Make an object invisible now; its index entry goes in the next commit."""
        meta = self._ledger.index.remove(object_id)
        volume = self._volume.current
        if meta is None or volume is None:
            return None
        location = volume.space.unplace(object_id)
        if location is not None and self._ledger.leases.is_leased(object_id):
            self._ledger.hide(meta, location)
            volume.space.segment_of(location).lingering.add(object_id)
        return volume.commit.submit(Delete(object_id))

    def drop_corrupt(self, object_id: bytes) -> None:
        self._ledger.corrupt_dropped += 1
        self.remove_nowait(object_id)

    def settle(self) -> None:
        """Forget the objects deleted under a lease that no lease holds any more."""
        self._ledger.reap_all()

    async def evict(self, need_bytes: int = 0) -> list[EvictedObject]:
        volume = self._volume.state
        options, ledger = self._volume.options, self._ledger
        ledger.leases.expire()
        self.settle()
        if ledger.held_bytes + need_bytes <= options.high_watermark * options.capacity_bytes:
            return []
        victims: list[tuple[ObjectMeta, Location]] = []
        deletes = []
        # their bytes are read into memory: what brings usage under the high watermark, and
        # beyond that at most ``eviction_batch_bytes`` on the way to the low one
        enough = max(options.eviction_batch_bytes,
                     ledger.held_bytes + need_bytes - options.high_watermark * options.capacity_bytes)
        batch = 0
        for meta in ledger.index.lru_order():
            if ledger.held_bytes + need_bytes <= options.low_watermark * options.capacity_bytes or batch >= enough:
                break
            location = volume.space.location(meta.object_id)
            if location is not None and not ledger.leases.is_leased(meta.object_id):
                victims.append((meta, location))
                deletes.append(self.remove_nowait(meta.object_id))
                batch += meta.size
        if not victims:
            return []
        ledger.evictions += len(victims)
        # pinned before this coroutine yields: compaction cannot delete what is still to be read
        space = volume.space
        pins = tuple({loc.segment: space.segment_of(loc) for _, loc in victims}.values())
        jobs = [(space.segment_of(loc).file, loc, meta.object_id) for meta, loc in victims]
        blobs = await volume.call(self._volume.body.read_many, jobs, pins=pins)
        await asyncio.gather(*(asyncio.shield(d) for d in deletes if d is not None), return_exceptions=True)
        evicted = []
        for (meta, _), blob in zip(victims, blobs):
            if isinstance(blob, RejectedState):
                ledger.corrupt_dropped += is_damage(blob)  # an unknown key id: evicted, not damage
            elif not isinstance(blob, BaseException):
                evicted.append(EvictedObject(meta, blob))
        return evicted
