"""The disk tier: sealed objects in append-only segment files on NVMe, indexed in LMDB.

``DiskTier(directory, capacity_bytes, *, keyring, segment_bytes=64 MiB, high_watermark=0.9,
low_watermark=0.75, compact_below_live_ratio=0.5, lease_ttl=30.0, fsync=True, cipher=None,
executor=None, name="disk", checkpoint_ops=4096, checkpoint_seconds=2.0)`` implements
``Tier`` (lifecycle in ``tiers.base``), plus ``compact() -> CompactionReport``. It is
composed of ``DiskStores`` (``tiers.disk.store``: reserved ranges, the group commit) and
``DiskLoads`` (``tiers.disk.load``: leases, verified reads); this module holds its state
(all declared in ``__init__``), lifecycle, removal and eviction, ``compact``, queries, ``stats``.

- Layout: ``directory/segments/seg-00000001.dat`` … (record format in ``tiers.disk.segments``)
  and ``directory/index/`` (LMDB, ``tiers.disk.index``); in-memory placement in
  ``tiers.disk.space``.
- Durability: the segments are the log (``tiers.disk.commit``, ``tiers.disk.log``); the LMDB
  index is a checkpoint of it, written in the background every ``checkpoint_ops`` ops or
  ``checkpoint_seconds`` (``tiers.disk.checkpoint``); a restart replays what it lacks.
  ``fsync=False`` skips every fdatasync and LMDB's sync: a killed process loses nothing, a
  power cut may.
- ``start`` first locks the directory (``tiers.disk.dirlock``: one tier, hence one daemon,
  per directory), then checks the index against the segments and replays the log past its last
  checkpoint (``tiers.disk.recovery``); ``compact`` rewrites sparse segments and never
  deletes a file a lease may still read (``tiers.disk.compaction``); ``close`` writes a
  last checkpoint.
- Capacity: ``bytes_used`` is the sealed size of live objects (and of deleted ones still
  leased); LRU order and the key index in memory, rebuilt at start in created-at order.
  ``evict`` removes LRU objects down to the low watermark, but past what brings usage under
  the high one at most ``eviction_batch_bytes`` (64 MiB) per call: their bytes are read
  into memory.
  A store is also refused (``CapacityError``) when it would leave the filesystem with less
  than ``free_space_reserve`` bytes (2 segments, between 1 and 64 MiB): that room stays for
  COMMIT records and index pages, so deletes — and with them recovery from a full disk —
  keep working.

Blocking work runs in the executor through ``tiers.disk.jobs``, which also translates
OSError and lmdb.Error into statetier errors; the record body codec is ``tiers.disk.body``.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator

from statetier.protocol.classify import is_damage
from statetier.protocol.errors import ConfigError, RejectedState, StatetierError
from statetier.protocol.keyring import Keyring
from ..base import EvictedObject, LeaseTable, LruIndex, ObjectMeta, StoreTicket, Tier, TierStats
from ..crypto import AtRestCipher
from .body import RecordBody
from .checkpoint import Checkpointer
from .commit import GroupCommit
from .compaction import CompactionReport, Compactor
from .dirlock import DirectoryLock
from .index import Delete, DiskIndex, IndexEntry, IndexOp, Location, Move, Put
from .jobs import DiskJobs
from .load import DiskLoads
from .log import CommitLog
from .recovery import recover
from .space import SegmentSpace, SegmentState
from .segments import RECORD_HEADER_BYTES, SegmentFile
from .store import DiskStores

__all__ = ["CompactionReport", "DiskTier"]

# One eviction reads its victims into memory (to hand them to the tier below): it takes at
# most this many bytes per call, not the whole band down to the low watermark — 15 % of a
# 16 GiB tier would be 2.4 GiB at once. The next store over the high watermark takes more.
EVICTION_BATCH_BYTES = 64 << 20


class DiskTier(DiskStores, DiskLoads, Tier):
    verifies_on_read = True  # read() checks every record's signature and payload digest (disk_body)
    reads_in_place = True

    def __init__(self, directory, capacity_bytes: int, *, keyring: Keyring, segment_bytes: int = 64 << 20,
                 high_watermark: float = 0.9, low_watermark: float = 0.75,
                 compact_below_live_ratio: float = 0.5, lease_ttl: float = 30.0, fsync: bool = True,
                 cipher: AtRestCipher | None = None, executor: Executor | None = None,
                 name: str = "disk", checkpoint_ops: int = 4096, checkpoint_seconds: float = 2.0) -> None:
        if capacity_bytes <= 0 or segment_bytes <= RECORD_HEADER_BYTES:
            raise ConfigError("disk tier needs a positive capacity and segments larger than a record header")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ConfigError("disk tier watermarks need 0 < low <= high <= 1")
        self.directory = Path(directory)
        self.capacity = capacity_bytes
        self.segment_bytes = segment_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.fsync = fsync
        self.free_space_reserve = max(1 << 20, min(2 * segment_bytes, 64 << 20))
        self.eviction_batch_bytes = EVICTION_BATCH_BYTES
        self._body = RecordBody(keyring, cipher)
        self.name = name
        self._compact_below = compact_below_live_ratio
        self._checkpoint_every = (checkpoint_ops, checkpoint_seconds)
        self._executor_given = executor
        self._executor: Executor | None = None
        self._leases = LeaseTable(lease_ttl)
        self._lru = LruIndex()
        self._tickets: dict[int, StoreTicket] = {}
        self._ticket_ids = itertools.count(1)
        self._storing: set[bytes] = set()
        self._reserved_bytes = 0
        self._hidden: dict[bytes, ObjectMeta] = {}  # deleted while leased
        self._hidden_bytes = 0
        self._jobs: DiskJobs | None = None
        self._index: DiskIndex | None = None
        self._space: SegmentSpace | None = None
        self._commit: GroupCommit | None = None
        self._log: CommitLog | None = None
        self._checkpointer: Checkpointer | None = None
        self._compactor: Compactor | None = None
        self._compact_lock: asyncio.Lock | None = None
        self._dir_lock = DirectoryLock(self.directory)
        self._is_started = False
        self.evictions = self.compactions_run = 0
        self.corrupt_dropped = self.recovery_dropped = self.recovery_segments_deleted = 0
        self.recovery_replayed = self.recovery_unverified = self.recovery_adopted = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_durable(self) -> bool:
        return self.fsync

    async def start(self) -> None:
        if self._is_started:
            raise RuntimeError("the disk tier is already started")
        self._executor = self._executor_given or ThreadPoolExecutor(4, thread_name_prefix=f"statetier-{self.name}")
        self._jobs = DiskJobs(self._executor)
        segment_dir, index_dir = self.directory / "segments", self.directory / "index"
        try:
            await self._call(self.directory.mkdir, 0o750, True, True)
            await self._call(self._dir_lock.acquire)  # before anything in it is read or written
            await self._call(segment_dir.mkdir, 0o750, True, True)
            self._index = await self._call(DiskIndex.open, index_dir, _index_map_size(self.capacity), self.fsync)
            found = await self._call(recover, self._index, segment_dir, self._body)
        except BaseException:
            await self._release()
            raise
        self._space = SegmentSpace(segment_dir, self.segment_bytes, found.next_segment)
        for number, size in found.segment_sizes.items():
            self._space.adopt(number, size)
        for entry in found.entries:
            self._space.place(entry.meta.object_id, entry.location)
            self._lru.add(entry.meta)
        self.recovery_dropped, self.recovery_segments_deleted = found.entries_dropped, found.segments_deleted
        self.recovery_replayed, self.recovery_unverified = found.replayed, found.unverified
        self.recovery_adopted = found.adopted
        self._checkpointer = Checkpointer(self._index, self._call, self._scan_from, found.mark,
                                          *self._checkpoint_every)
        self._log = CommitLog(self._space, self._call, self._checkpointer, self._resolve, self.fsync,
                              found.mark.last_seq + 1)
        self._commit = GroupCommit(self._log.flush)
        self._compactor = Compactor(self._space, self._commit, self._call, self._leases.is_leased,
                                    self._drop_corrupt, self._checkpoint_all, self._compact_below)
        self._compact_lock = asyncio.Lock()
        self._is_started = True

    async def close(self) -> None:
        if not self._is_started:
            return
        self._is_started = False
        await self._commit.drain()
        try:
            await self._checkpointer.force()
        except StatetierError:
            pass  # the log still holds it all: the next start replays it
        await self._jobs.wait_idle()
        await self._release()

    async def _release(self) -> None:
        files = [s.file for s in self._space.segments.values()] if self._space else []
        index, self._index = self._index, None
        if self._executor is not None:
            await self._call(_close_all, files, index)
            if self._executor_given is None:
                self._executor.shutdown(wait=False)
            self._executor = None
        self._dir_lock.release()

    def _require_started(self) -> None:
        if not self._is_started:
            raise RuntimeError(f"the {self.name} tier is not started")

    # ------------------------------------------------------------------ store
    # ------------------------------------------------------------------ removal

    async def delete(self, object_id: bytes) -> bool:
        self._require_started()
        done = self._remove_nowait(object_id)
        if done is None:
            return False
        await asyncio.shield(done)
        return True

    def _remove_nowait(self, object_id: bytes) -> asyncio.Future | None:
        """Make an object invisible now; its index entry goes in the next commit."""
        meta = self._lru.remove(object_id)
        if meta is None:
            return None
        location = self._space.unplace(object_id)
        if self._leases.is_leased(object_id):
            self._hidden[object_id] = meta
            self._hidden_bytes += meta.size
            self._space.segment_of(location).lingering.add(object_id)
        return self._commit.submit(Delete(object_id))

    def _drop_corrupt(self, object_id: bytes) -> None:
        self.corrupt_dropped += 1
        self._remove_nowait(object_id)

    def _settle_hidden(self) -> None:
        for object_id in [oid for oid in self._hidden if not self._leases.is_leased(oid)]:
            self._hidden_bytes -= self._hidden.pop(object_id).size

    async def evict(self, need_bytes: int = 0) -> list[EvictedObject]:
        self._require_started()
        self._leases.expire()
        self._settle_hidden()
        if self._bytes_used() + need_bytes <= self.high_watermark * self.capacity:
            return []
        victims: list[tuple[ObjectMeta, Location]] = []
        deletes = []
        # their bytes are read into memory: what brings usage under the high watermark, and
        # beyond that at most ``eviction_batch_bytes`` on the way to the low one
        enough = max(self.eviction_batch_bytes, self._bytes_used() + need_bytes - self.high_watermark * self.capacity)
        batch = 0
        for meta in self._lru.lru_order():
            if self._bytes_used() + need_bytes <= self.low_watermark * self.capacity or batch >= enough:
                break
            if not self._leases.is_leased(meta.object_id):
                victims.append((meta, self._space.location(meta.object_id)))
                deletes.append(self._remove_nowait(meta.object_id))
                batch += meta.size
        if not victims:
            return []
        self.evictions += len(victims)
        # pinned before this coroutine yields: compaction cannot delete what is still to be read
        pins = tuple({loc.segment: self._space.segment_of(loc) for _, loc in victims}.values())
        jobs = [(self._space.segment_of(loc).file, loc, meta.object_id) for meta, loc in victims]
        blobs = await self._call(self._body.read_many, jobs, pins=pins)
        await asyncio.gather(*(asyncio.shield(d) for d in deletes), return_exceptions=True)
        evicted = []
        for (meta, _), blob in zip(victims, blobs):
            if isinstance(blob, RejectedState):
                self.corrupt_dropped += is_damage(blob)  # an unknown key id: evicted, not damage
            elif not isinstance(blob, BaseException):
                evicted.append(EvictedObject(meta, blob))
        return evicted

    async def compact(self) -> CompactionReport:
        """Rewrite sparse sealed segments; delete old files no lease can still read."""
        self._require_started()
        self._leases.expire()
        self._settle_hidden()
        async with self._compact_lock:
            self.compactions_run += 1
            return await self._compactor.run()

    # ------------------------------------------------------------------ queries

    async def contains(self, object_id: bytes) -> bool:
        return object_id in self._lru

    async def get_meta(self, object_id: bytes) -> ObjectMeta | None:
        return self._lru.get(object_id)

    async def find_by_key(self, key_digest: bytes) -> list[ObjectMeta]:
        self._require_started()
        return self._lru.by_key(key_digest)

    async def iter_objects(self) -> AsyncIterator[ObjectMeta]:
        for meta in self._lru.lru_order():
            if meta.object_id in self._lru:
                yield meta

    def stats(self) -> TierStats:
        self._settle_hidden()
        space = self._space
        compacted = self._compactor.totals if self._compactor else CompactionReport()
        disk = space.disk_bytes if space else 0
        live = space.live_record_bytes if space else 0
        return TierStats(
            tier=self.name, objects=len(self._lru), bytes_used=self._bytes_used(), capacity=self.capacity,
            leases=len(self._leases), inflight=len(self._tickets) + len(self._leases),
            evictions=self.evictions, compactions_run=self.compactions_run,
            compactions_blocked=compacted.segments_blocked, bytes_reclaimed=compacted.bytes_reclaimed,
            extra={
                "corrupt_dropped": self.corrupt_dropped,
                "segments_compacted": compacted.segments_compacted,
                "objects_moved": compacted.objects_moved,
                "recovery_dropped": self.recovery_dropped,
                "recovery_segments_deleted": self.recovery_segments_deleted,
                "segments": len(space.segments) if space else 0,
                "segment_file_bytes": disk,
                "live_record_bytes": live,
                "dead_bytes": disk - live,
                "reserved_bytes": self._reserved_bytes,
                "deleted_but_leased": len(self._hidden),
                "leases_expired": self._leases.expired_total,
                "index_batches": self._commit.batches if self._commit else 0,
                "index_ops": self._commit.ops if self._commit else 0,
                "index_ops_waiting": self._commit.waiting if self._commit else 0,
                "commit_record_bytes": self._log.commit_bytes if self._log else 0,
                "log_fallbacks": self._log.fallbacks if self._log else 0,
                "checkpoints": self._checkpointer.runs if self._checkpointer else 0,
                "checkpoint_failures": self._checkpointer.failures if self._checkpointer else 0,
                "ops_not_checkpointed": self._checkpointer.waiting if self._checkpointer else 0,
                "recovery_replayed": self.recovery_replayed,
                "recovery_unverified": self.recovery_unverified,
                "recovery_adopted": self.recovery_adopted,
            },
        )

    def _bytes_used(self) -> int:
        return self._lru.bytes_used + self._hidden_bytes

    def _leased_bytes(self) -> int:
        return sum(meta.size for meta in map(self._lru.get, self._leases.leased_objects()) if meta is not None)

    # ------------------------------------------------------------------ executor edge

    async def _call(self, fn, *args, pins: tuple[SegmentState, ...] = ()):
        return await self._jobs.run(fn, *args, pins=pins)

    def _resolve(self, op: IndexOp) -> IndexOp | None:
        """What ``op`` does to the index, decided as its batch forms (None: nothing)."""
        if not isinstance(op, Move):
            return op
        if self._space.location(op.object_id) != op.old:
            return None  # deleted or dropped since compaction copied it: the delete wins
        return Put(IndexEntry(op.new, self._lru.get(op.object_id)))

    async def _checkpoint_all(self) -> None:
        """A durable checkpoint holding every op submitted so far (their batches first)."""
        await self._commit.settled()
        await self._checkpointer.force()

    def _scan_from(self) -> int:
        """The lowest segment a COMMIT record not yet checkpointed may lie in."""
        inflight = self._log.inflight_segment if self._log else None
        active = self._space.active.number
        return active if inflight is None else min(active, inflight)



def _index_map_size(capacity: int) -> int:
    # an entry is ~100 bytes and objects are hundreds of bytes at the very least
    return min(max(64 << 20, capacity // 16), 1 << 40)


def _close_all(files: list[SegmentFile], index: DiskIndex | None) -> None:
    for file in files:
        file.close()
    if index is not None:
        index.close()
