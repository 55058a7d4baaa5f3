"""Compaction of disk segments: live records copied out of sparse segments; an old file is
deleted only when no reader can still be in it.

``Compactor.run() -> CompactionReport`` (``DiskTier.compact`` serialises calls):

1. Each sealed, unpinned segment whose live ratio is under the threshold is evacuated:
   every live record is copied to the active segment as generation + 1 (in the
   executor, both segments pinned), then all of its moves commit in one durable batch.
   A ``Move`` applies only if the entry is still where it was copied from, so a delete
   racing the copy wins. The segment is then *drained*.
2. Each drained segment is deleted when ``is_deletable``: no pins, nothing live, and no
   *lingering* id leased — an id lingers in a segment when its index entry left while a
   lease (taken before the move or the delete) still points there. Otherwise it counts
   as blocked and the next run retries. Bytes under a lease are never touched.

``CompactionReport(segments_compacted, segments_blocked, bytes_reclaimed, objects_moved)``
for one run (``bytes_reclaimed``: file bytes deleted minus live bytes copied out of them);
``Compactor.totals`` sums every run, counted as the work happens.
"""

from __future__ import annotations

import asyncio
from dataclasses import astuple, dataclass, replace
from typing import Awaitable, Callable

from statetier.protocol.errors import RejectedState
from statetier.tiers.disk_commit import GroupCommit
from statetier.tiers.disk_index import Location, Move
from statetier.tiers.disk_space import SegmentSpace, SegmentState


@dataclass(frozen=True, slots=True)
class CompactionReport:
    segments_compacted: int = 0
    segments_blocked: int = 0
    bytes_reclaimed: int = 0
    objects_moved: int = 0

    def __sub__(self, other: "CompactionReport") -> "CompactionReport":
        return CompactionReport(*(a - b for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True, slots=True)
class _Copied:
    object_id: bytes
    old: Location
    new: Location
    target: SegmentState  # holds one reservation pin until the move settles


class Compactor:
    def __init__(self, space: SegmentSpace, commit: GroupCommit, call: Callable[..., Awaitable],
                 is_leased: Callable[[bytes], bool], drop_corrupt: Callable[[bytes], None],
                 below_live_ratio: float) -> None:
        self._space = space
        self._commit = commit
        self._call = call
        self._is_leased = is_leased
        self._drop_corrupt = drop_corrupt
        self.below_live_ratio = below_live_ratio
        self.totals = CompactionReport()  # counted as work happens, so a cancelled run counts too

    def _count(self, **more: int) -> None:
        self.totals = replace(self.totals, **{k: getattr(self.totals, k) + v for k, v in more.items()})

    async def run(self) -> CompactionReport:
        before = self.totals
        for segment in self._space.compaction_candidates(self.below_live_ratio):
            await self._evacuate(segment)
            segment.is_drained = not segment.objects
        for segment in self._space.drained():
            segment.forget_unleased(self._is_leased)
            if not segment.is_deletable:
                self._count(segments_blocked=1)
                continue
            self._space.forget(segment)
            self._count(segments_compacted=1, bytes_reclaimed=segment.tail - segment.moved_out_bytes)
            await self._call(segment.file.unlink)
        return self.totals - before

    async def _evacuate(self, segment: SegmentState) -> None:
        copies: list[_Copied] = []
        futures: list[asyncio.Future] = []
        try:
            for object_id in list(segment.objects):
                copied = await self._copy(segment, object_id)
                if copied is not None:
                    copies.append(copied)
            for copied in copies:
                futures.append(self._commit.submit(Move(copied.object_id, copied.old, copied.new),
                                                   sync=copied.target,
                                                   on_result=lambda result, c=copied: self._settle(c, result)))
        finally:
            for copied in copies[len(futures):]:
                copied.target.unpin()
        await asyncio.gather(*(asyncio.shield(f) for f in futures), return_exceptions=True)

    async def _copy(self, segment: SegmentState, object_id: bytes) -> _Copied | None:
        old = self._space.location(object_id)
        if old is None or old.segment != segment.number:
            return None
        target, offset = self._space.reserve(old.record_len)
        try:
            await self._call(segment.file.copy_record_to, target.file, old.offset, offset, old.record_len,
                             object_id, old.generation, pins=(segment, target))
        except RejectedState:
            target.unpin()
            self._drop_corrupt(object_id)
            return None
        except BaseException:
            target.unpin()
            raise
        return _Copied(object_id, old, Location(target.number, offset, old.record_len, old.generation + 1), target)

    def _settle(self, copied: _Copied, result: object) -> None:
        copied.target.unpin()
        if result is not True or self._space.location(copied.object_id) != copied.old:
            return
        source = self._space.segment_of(copied.old)
        self._space.place(copied.object_id, copied.new)
        source.moved_out_bytes += copied.old.record_len
        self._count(objects_moved=1)
        if self._is_leased(copied.object_id):
            source.lingering.add(copied.object_id)
