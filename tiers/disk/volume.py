"""The medium of the disk tier: its directory of segment files and LMDB index, while started.

- ``DiskVolume(options, body, executor)`` — opens and closes the directory for the tier.
  ``open(ledger, drop_corrupt)`` first locks the directory (``tiers.disk.dirlock``: one
  open tier, hence one daemon, per directory), then creates ``segments/`` and ``index/``,
  opens the index, recovers (replays the log past the last checkpoint,
  ``tiers.disk.recovery``), fills the ledger's index and wires the group commit; ``close()`` drains the commits, writes
  a last checkpoint, closes every file and lets the lock go. ``state`` is the ``OpenVolume`` while
  started (``RuntimeError`` otherwise); ``current`` is the last one opened, for stats.
- ``OpenVolume`` — what exists while started: ``jobs`` (the executor edge,
  ``tiers.disk.jobs``), ``index``, ``space`` (segments and placements), ``commit`` (the group
  commit), ``log``, ``checkpointer``, ``compactor``, and what recovery found (``recovered``).
  ``call(fn, *args, pins=…)`` runs blocking work in the executor.

The directories are mode 0700 and the files 0600 (segments, index, lock), whatever the
umask: a worker in the daemon's group, there to reach the socket, reads nothing here.

The parts of ``DiskTier`` (``tiers.disk.stores``, ``loads``, ``removal``) each receive the
tier's ``Ledger`` and this volume.
"""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from statetier.protocol.errors import StatetierError

from ..ledger import Ledger
from .body import RecordBody
from .checkpoint import Checkpointer
from .commit import GroupCommit
from .compaction import Compactor
from .dirlock import DirectoryLock
from .index import DiskIndex, IndexEntry, IndexOp, Location, Move, Put
from .jobs import DiskJobs
from .log import CommitLog
from .options import DiskTierOptions
from .recovery import Recovered, recover
from .segments import SegmentFile
from .space import SegmentSpace, SegmentState


@dataclass(slots=True)
class OpenVolume:
    """See the module docstring."""

    jobs: DiskJobs
    index: DiskIndex
    space: SegmentSpace
    commit: GroupCommit
    log: CommitLog
    checkpointer: Checkpointer
    compactor: Compactor
    recovered: Recovered

    async def call(self, fn: Callable[..., Any], *args: Any, pins: tuple[SegmentState, ...] = ()) -> Any:
        return await self.jobs.run(fn, *args, pins=pins)

    async def checkpoint_all(self) -> None:
        """A durable checkpoint holding every op submitted so far (their batches first)."""
        await self.commit.settled()
        await self.checkpointer.force()


class DiskVolume:
    """See the module docstring."""

    def __init__(self, options: DiskTierOptions, body: RecordBody, executor: Executor | None) -> None:
        self.options = options
        self.body = body
        self._given_executor = executor
        self._executor: Executor | None = None
        self._jobs: DiskJobs | None = None
        self._open: OpenVolume | None = None
        self._lock = DirectoryLock(options.directory)
        self.is_started = False

    @property
    def state(self) -> OpenVolume:
        if not self.is_started or self._open is None:
            raise RuntimeError(f"the {self.options.name} tier is not started")
        return self._open

    def require_started(self) -> None:
        """``RuntimeError`` unless started (``state`` raises it too)."""
        self.state  # noqa: B018

    @property
    def current(self) -> OpenVolume | None:
        return self._open

    async def open(self, ledger: Ledger[Location], drop_corrupt: Callable[[bytes], None]) -> OpenVolume:
        if self.is_started:
            raise RuntimeError("the disk tier is already started")
        options = self.options
        self._executor = self._given_executor or ThreadPoolExecutor(4, thread_name_prefix=f"statetier-{options.name}")
        jobs = self._jobs = DiskJobs(self._executor)
        segment_dir, index_dir = options.directory / "segments", options.directory / "index"
        index: DiskIndex | None = None
        try:
            await jobs.run(_make_private_directories, options.directory)
            await jobs.run(self._lock.acquire)  # before anything in it is read or written
            await jobs.run(_make_private_directories, segment_dir, index_dir)
            index = await jobs.run(DiskIndex.open, index_dir, _index_map_size(options.capacity_bytes), options.fsync)
            found: Recovered = await jobs.run(recover, index, segment_dir, self.body)
        except BaseException:
            await self._release([], index)
            raise
        assert index is not None
        space = SegmentSpace(segment_dir, options.segment_bytes, found.next_segment, self.body.records)
        for number, size in found.segment_sizes.items():
            space.adopt(number, size)
        for entry in found.entries:
            space.place(entry.meta.object_id, entry.location)
            ledger.index.add(entry.meta)
        volume: OpenVolume

        def resolve(op: IndexOp) -> IndexOp | None:
            """What ``op`` does to the index, decided as its batch forms (None: nothing)."""
            if not isinstance(op, Move):
                return op
            meta = ledger.index.get(op.object_id)
            if space.location(op.object_id) != op.old or meta is None:
                return None  # deleted or dropped since compaction copied it: the delete wins
            return Put(IndexEntry(op.new, meta))

        def scan_from() -> int:
            """The lowest segment a COMMIT record not yet checkpointed may lie in."""
            inflight = volume.log.inflight_segment
            active = space.active.number
            return active if inflight is None else min(active, inflight)

        checkpointer = Checkpointer(index, jobs.run, scan_from, found.mark, options.checkpoint_ops,
                                    options.checkpoint_seconds)
        log = CommitLog(space, jobs.run, checkpointer, resolve, options.fsync, found.mark.last_seq + 1)
        commit = GroupCommit(log.flush)
        compactor = Compactor(space, commit, jobs.run, ledger.leases.is_leased, drop_corrupt,
                              lambda: volume.checkpoint_all(), options.compact_below_live_ratio)
        volume = OpenVolume(jobs, index, space, commit, log, checkpointer, compactor, found)
        self._open = volume
        self.is_started = True
        return volume

    async def close(self) -> None:
        if not self.is_started or self._open is None:
            return
        self.is_started = False
        volume = self._open
        await volume.commit.drain()
        try:
            await volume.checkpointer.force()
        except StatetierError:
            pass  # the log still holds it all: the next start replays it
        await volume.jobs.wait_idle()
        await self._release([s.file for s in volume.space.segments.values()], volume.index)

    async def _release(self, files: list[SegmentFile], index: DiskIndex | None) -> None:
        if self._executor is not None and self._jobs is not None:
            await self._jobs.run(_close_all, files, index)
            if self._given_executor is None:
                self._executor.shutdown(wait=False)
            self._executor = None
        self._lock.release()


def _index_map_size(capacity: int) -> int:
    # an entry is ~100 bytes and objects are hundreds of bytes at the very least
    return min(max(64 << 20, capacity // 16), 1 << 40)


def _make_private_directories(*directories: Path) -> None:
    """The tier's directories, readable by the daemon's uid only (mode 0700, whatever the
    umask)."""
    for directory in directories:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)


def _close_all(files: list[SegmentFile], index: DiskIndex | None) -> None:
    for file in files:
        file.close()
    if index is not None:
        index.close()
