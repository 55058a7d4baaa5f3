"""An extent tier: objects in extents of one preallocated region (the host arena, the device pool).

- ``ExtentTierOptions`` — capacity, watermarks, lease TTL and the clock leases run on,
  granularity, the inline copy size, name, the eviction policy (``LruPolicy``);
  ``HostTierOptions`` and ``DeviceTierOptions`` extend it.
- ``ExtentTier(config, medium, executor, offers_store_view)`` — a ``ComposedTier``
  (``tiers.composed``) over one ``Ledger`` (``tiers.ledger``) and one ``ExtentRegion``
  (``tiers.memory.region``), of parts that each receive both: ``ExtentStores`` (reservations counted against
  capacity, visibility at ``complete_store(success=True)``), ``ExtentLoads`` (leases, reads,
  frees deferred past the last lease), ``ExtentRemoval`` (delete, exact LRU eviction) and
  ``ExtentCompaction`` (``compact()``). ``HostTier`` and ``DeviceTier`` are this with their
  medium (``HostArena``, ``DevicePool``) and the calls only they offer.

Bookkeeping runs on
the event loop only; executor threads only copy bytes, and a free waits for the jobs
pinning its extent (``tiers.memory.pins``), so a cancelled write or move never scribbles on
space that was handed out again.
"""

from __future__ import annotations

from collections.abc import Coroutine
from concurrent.futures import Executor
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from statetier.protocol.errors import ConfigError
from statetier.protocol.thresholds import INLINE_COPY_BYTES

from ..base import Clock, EvictedObject, TierStats
from ..composed import IndexedTier
from ..eviction import EvictionPolicy, LruPolicy
from ..ledger import Ledger
from .compaction import ExtentCompaction
from .loads import ExtentLoads
from .records import ExtentCompactionReport, ObjectExtent
from .region import ExtentMedium, ExtentRegion
from .removal import ExtentRemoval
from .stores import ExtentStores

@dataclass(frozen=True, slots=True)
class ExtentTierOptions:
    """What every extent tier is configured with."""

    capacity_bytes: int
    high_watermark: float = 0.9
    low_watermark: float = 0.75
    lease_ttl: float = 30.0
    granularity: int = 4096
    inline_copy_bytes: int = INLINE_COPY_BYTES  # the rule of ``protocol.thresholds``
    name: str = "extent"
    clock: Clock = field(default=time.monotonic, repr=False, compare=False)
    #: makes the order eviction takes objects in (``tiers.eviction``): least recently used first
    eviction_policy: Callable[[], EvictionPolicy] = field(default=LruPolicy, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.capacity_bytes < self.granularity:
            raise ConfigError(f"{self.name}: capacity_bytes {self.capacity_bytes} is below one granule "
                              f"({self.granularity})")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError(f"{self.name}: need 0 < low_watermark <= high_watermark <= 1")


class ExtentTier(IndexedTier):
    """See the module docstring."""

    answers_in_memory = True  # the index and leases are dicts of this process

    def __init__(self, config: ExtentTierOptions, medium: ExtentMedium, executor: Executor | None, *,
                 offers_store_view: bool) -> None:
        self.capacity = config.capacity_bytes
        self.config = config
        self._ledger: Ledger[ObjectExtent] = Ledger(config.name, config.lease_ttl, config.clock,
                                                         config.eviction_policy())
        self._region = ExtentRegion(medium, config.name, config.capacity_bytes, config.granularity,
                                    config.inline_copy_bytes, executor)
        self._loads = ExtentLoads(self._ledger, self._region)
        self._stores = ExtentStores(self._ledger, self._region, offers_store_view)
        self._removal = ExtentRemoval(self._ledger, self._region, self._loads, config.capacity_bytes,
                                      config.high_watermark, config.low_watermark)
        self._compaction = ExtentCompaction(self._ledger, self._region, self._loads)
        super().__init__(config.name, self._ledger, self._stores, self._loads, self._removal, self._removal)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self._region.open()

    async def close(self) -> None:
        space = self._region.begin_close()
        if space is None:
            return
        await space.jobs.wait_all()
        self._loads.end_all()
        self._stores.close_all()
        self._ledger.forget_all()
        space.places.clear()
        await self._region.finish_close(space)

    # ------------------------------------------------------------------ beyond ComposedTier

    def expire_leases(self) -> int:
        """Drop leases past their deadline (and free what they alone kept); for maintenance."""
        return self._loads.expire_leases()

    def evict_sparing_copies(self, need_bytes: int, is_held_below: Callable[[bytes], Awaitable[bool]]
                             ) -> Coroutine[Any, Any, list[EvictedObject]]:
        return self._removal.evict_sparing_copies(need_bytes, is_held_below)

    def compact(self) -> Coroutine[Any, Any, ExtentCompactionReport]:
        """Slide unleased objects down into free extents below them (``ExtentCompaction``)."""
        return self._compaction.compact()

    # ------------------------------------------------------------------ the index (``IndexedTier``)

    @property
    def bytes_used(self) -> int:
        """Object bytes held: visible, reserved by stores in progress, deleted but leased."""
        return self._ledger.bytes_used

    def stats(self) -> TierStats:
        space, ledger, compaction = self._region.current, self._ledger, self._compaction
        alloc = space.alloc if space is not None else None
        return TierStats(
            tier=self.name,
            objects=len(ledger.index),
            bytes_used=ledger.bytes_used,
            capacity=self.capacity,
            leases=len(ledger.leases),
            inflight=len(ledger.stores) + len(ledger.leases),
            evictions=ledger.evictions,
            compactions_run=compaction.runs,
            compactions_blocked=compaction.blocked,
            bytes_reclaimed=compaction.bytes_reclaimed,
            extra={
                "granularity": self.config.granularity,
                "extent_bytes_allocated": alloc.used_bytes if alloc else 0,
                "largest_free_extent": alloc.largest_free if alloc else 0,
                "fragmentation": alloc.fragmentation if alloc else 0.0,
                "bytes_moved": compaction.bytes_moved,
                "deleted_but_leased": len(ledger.hidden),
                "leases_expired": ledger.leases.expired_total,
                "lease_violations": self._loads.lease_violations,
            },
        )
