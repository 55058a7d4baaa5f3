"""The disk tier: sealed objects in append-only segment files on NVMe, indexed in LMDB.

``DiskTier(DiskTierOptions(directory, capacity_bytes, …), *, keyring, cipher=None,
executor=None)`` implements ``Tier`` (lifecycle in ``tiers.base``; ``read(into=…)`` preads
straight into a caller's buffer), with ``compact() -> SegmentCompactionReport``. Its medium is a
``DiskVolume`` (``tiers.disk.volume``: the directory while started); its bookkeeping one ``Ledger``
(``tiers.ledger``); as a ``ComposedTier`` (``tiers.composed``) each call goes to its part:
``DiskStores`` (``tiers.disk.stores``: reserved ranges, the group commit), ``DiskLoads``
(``tiers.disk.loads``: leases, verified reads) and ``DiskRemoval`` (``tiers.disk.removal``:
delete, dropped damage, eviction); ``Compactor`` (``tiers.disk.compaction``) for ``compact``.

- Layout: ``directory/segments/seg-00000001.dat`` … (record format in ``tiers.disk.records``)
  and ``directory/index/`` (LMDB, ``tiers.disk.index``); in-memory placement in
  ``tiers.disk.space``. The directories are 0700 and the files 0600: only the daemon reads them.
- Durability: the segments are the log (``tiers.disk.commit``, ``tiers.disk.log``); the LMDB
  index is a checkpoint of it, written in the background every ``checkpoint_ops`` ops or
  ``checkpoint_seconds`` (``tiers.disk.checkpoint``); a restart replays what it lacks.
  ``fsync=False`` skips every fdatasync and LMDB's sync: a killed process loses nothing, a
  power cut may.
- ``start`` first locks the directory (``tiers.disk.dirlock``: one tier, hence one daemon,
  per directory), then checks the index against the segments and replays the log past its last
  checkpoint (``tiers.disk.recovery``); ``compact`` rewrites sparse segments and never
  deletes a file a lease may still read; ``close`` writes a last checkpoint.
- Capacity: ``bytes_used`` is the sealed size of live objects (and of deleted ones still
  leased); LRU order and the key index in memory, rebuilt at start in created-at order.
  A store is refused (``CapacityError``) when it would leave the filesystem with less than
  ``free_space_reserve`` bytes: that room stays for COMMIT records and index pages, so
  deletes — and with them recovery from a full disk — keep working.

Blocking work runs in the executor through ``tiers.disk.jobs``, which also translates
OSError and lmdb.Error into statetier errors; the record body codec is ``tiers.disk.body``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from statetier.protocol.keyring import Keyring

from ..base import TierStats
from ..composed import IndexedTier
from ..crypto import AtRestCipher
from ..ledger import Ledger
from .body import RecordBody
from .compaction import SegmentCompactionReport
from .index import Location
from .loads import DiskLoads
from .options import DiskTierOptions
from .removal import DiskRemoval
from .stores import DiskStores
from .volume import DiskVolume

__all__ = ["DiskTier", "SegmentCompactionReport"]


class DiskTier(IndexedTier):
    """See the module docstring."""

    verifies_on_read = True  # read() checks every record's signature and payload digest (tiers.disk.body)

    def __init__(self, options: DiskTierOptions, *, keyring: Keyring, cipher: AtRestCipher | None = None,
                 executor: Executor | None = None) -> None:
        self.options = options
        self.capacity = options.capacity_bytes
        self._ledger: Ledger[Location] = Ledger(options.name, options.lease_ttl, options.clock,
                                                     options.eviction_policy())
        self._volume = DiskVolume(options, RecordBody(keyring, cipher), executor)
        self._removal = DiskRemoval(self._ledger, self._volume)
        self._loads = DiskLoads(self._ledger, self._volume, self._removal)
        super().__init__(options.name, self._ledger, DiskStores(self._ledger, self._volume, self._removal),
                         self._loads, self._removal, self._removal)
        self._compact_lock = asyncio.Lock()
        self.compactions_run = 0

    @property
    def is_durable(self) -> bool:  # type: ignore[override]  # a class attribute in Tier
        return self.options.fsync

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self._volume.open(self._ledger, self._removal.drop_corrupt)

    async def close(self) -> None:
        await self._volume.close()

    # ------------------------------------------------------------------ beyond ComposedTier

    async def compact(self) -> SegmentCompactionReport:
        """Rewrite sparse sealed segments; delete old files no lease can still read."""
        volume = self._volume.state
        self._ledger.leases.expire()
        self._removal.settle()
        async with self._compact_lock:
            self.compactions_run += 1
            return await volume.compactor.run()

    # ------------------------------------------------------------------ queries (``IndexedTier``)

    def _require_open(self) -> None:
        self._volume.require_started()

    def stats(self) -> TierStats:
        self._removal.settle()
        ledger, volume = self._ledger, self._volume.current
        compacted = volume.compactor.totals if volume else SegmentCompactionReport()
        disk = volume.space.disk_bytes if volume else 0
        live = volume.space.live_record_bytes if volume else 0
        found = volume.recovered if volume else None
        return TierStats(
            tier=self.name, objects=len(ledger.index), bytes_used=ledger.held_bytes, capacity=self.capacity,
            leases=len(ledger.leases), inflight=len(ledger.stores) + len(ledger.leases),
            evictions=ledger.evictions, compactions_run=self.compactions_run,
            compactions_blocked=compacted.segments_blocked, bytes_reclaimed=compacted.bytes_reclaimed,
            extra={
                "corrupt_dropped": ledger.corrupt_dropped,
                "segments_compacted": compacted.segments_compacted,
                "objects_moved": compacted.objects_moved,
                "recovery_dropped": found.entries_dropped if found else 0,
                "recovery_segments_deleted": found.segments_deleted if found else 0,
                "segments": len(volume.space.segments) if volume else 0,
                "segment_file_bytes": disk,
                "live_record_bytes": live,
                "dead_bytes": disk - live,
                "reserved_bytes": ledger.reserved_bytes,
                "deleted_but_leased": len(ledger.hidden),
                "leases_expired": ledger.leases.expired_total,
                "index_batches": volume.commit.batches if volume else 0,
                "index_ops": volume.commit.ops if volume else 0,
                "index_ops_waiting": volume.commit.waiting if volume else 0,
                "commit_record_bytes": volume.log.commit_bytes if volume else 0,
                "log_fallbacks": volume.log.fallbacks if volume else 0,
                "delete_marks_failed": volume.log.marks_failed if volume else 0,
                "checkpoints": volume.checkpointer.runs if volume else 0,
                "checkpoint_failures": volume.checkpointer.failures if volume else 0,
                "ops_not_checkpointed": volume.checkpointer.waiting if volume else 0,
                "recovery_replayed": found.replayed if found else 0,
                "recovery_unverified": found.unverified if found else 0,
                "recovery_adopted": found.adopted if found else 0,
                "recovery_legacy_segments": found.legacy_segments if found else 0,
            },
        )
