"""Compaction of disk segments: live records copied out of sparse segments; an old file is
deleted only when no reader can still be in it.

``Compactor.run() -> SegmentCompactionReport`` (``DiskTier.compact`` serialises calls):

1. Each sealed, unpinned segment whose live ratio is under the threshold is evacuated:
   the headers of its live records are read, then every live record is copied to the
   active segment as generation + 1 (in the executor, both segments pinned), then all of
   its moves commit in one durable batch. A ``Move`` applies only if the entry is still
   where it was copied from, so a delete racing the copy wins. The segment is then
   *drained*.
2. Each drained segment is deleted when ``is_deletable``: no pins, nothing live, and no
   *lingering* id leased — an id lingers in a segment when its index entry left while a
   lease (taken before the move or the delete) still points there. Otherwise it counts
   as blocked and the next run retries. Bytes under a lease are never touched. Before
   the first file goes, ``checkpoint()`` makes the index durably hold every op submitted
   so far — the moves, and the deletes that emptied the file: a restart must never find
   an index entry pointing into a deleted file, nor need a COMMIT record from one.

``SegmentCompactionReport(segments_compacted, segments_blocked, bytes_reclaimed, objects_moved)``
for one run (``bytes_reclaimed``: file bytes deleted minus live bytes copied out of them);
``Compactor.totals`` sums every run, counted as the work happens. ``read_headers(file,
live)`` (blocking, in the executor) reads the record headers step 1 starts from.
"""

from __future__ import annotations

import asyncio
from dataclasses import astuple, dataclass, replace
from functools import partial
from typing import Any, Awaitable, Callable

from statetier.protocol.errors import CorruptPayload, RejectedState
from .commit import GroupCommit
from .index import Location, Move
from .space import SegmentSpace, SegmentState
from .segments import RecordHeader, SegmentFile


@dataclass(frozen=True, slots=True)
class SegmentCompactionReport:
    segments_compacted: int = 0
    segments_blocked: int = 0
    bytes_reclaimed: int = 0
    objects_moved: int = 0

    def __sub__(self, other: "SegmentCompactionReport") -> "SegmentCompactionReport":
        return SegmentCompactionReport(*(a - b for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True, slots=True)
class _Copied:
    object_id: bytes
    old: Location
    new: Location
    target: SegmentState  # holds one reservation pin until the move settles


class Compactor:
    def __init__(self, space: SegmentSpace, commit: GroupCommit, call: Callable[..., Awaitable[Any]],
                 is_leased: Callable[[bytes], bool], drop_corrupt: Callable[[bytes], None],
                 checkpoint: Callable[[], Awaitable[None]], below_live_ratio: float) -> None:
        self._space = space
        self._checkpoint = checkpoint
        self._commit = commit
        self._call = call
        self._is_leased = is_leased
        self._drop_corrupt = drop_corrupt
        self.below_live_ratio = below_live_ratio
        self.totals = SegmentCompactionReport()  # counted as work happens, so a cancelled run counts too

    def _count(self, **more: int) -> None:
        self.totals = replace(self.totals, **{k: getattr(self.totals, k) + v for k, v in more.items()})

    async def run(self) -> SegmentCompactionReport:
        before = self.totals
        for segment in self._space.compaction_candidates(self.below_live_ratio):
            await self._evacuate(segment)
            segment.is_drained = not segment.objects
        is_checkpointed = False
        for segment in self._space.drained():
            segment.forget_unleased(self._is_leased)
            if not segment.is_deletable:
                self._count(segments_blocked=1)
                continue
            if not is_checkpointed:
                await self._checkpoint()
                is_checkpointed = True
                if not segment.is_deletable:  # a lease came while the checkpoint ran
                    self._count(segments_blocked=1)
                    continue
            self._space.forget(segment)
            self._count(segments_compacted=1, bytes_reclaimed=segment.tail - segment.moved_out_bytes)
            await self._call(segment.file.unlink)
        return self.totals - before

    async def _evacuate(self, segment: SegmentState) -> None:
        live = [(object_id, location) for object_id in list(segment.objects)
                if (location := self._space.location(object_id)) is not None and location.segment == segment.number]
        headers = await self._call(read_headers, segment.file, live, pins=(segment,)) if live else []
        copies: list[_Copied] = []
        futures: list[asyncio.Future[object]] = []
        try:
            for (object_id, location), header in zip(live, headers):
                if isinstance(header, RejectedState):
                    self._drop_corrupt(object_id)
                    continue
                copied = await self._copy(segment, object_id, location, header)
                if copied is not None:
                    copies.append(copied)
            for copied in copies:
                futures.append(self._commit.submit(Move(copied.object_id, copied.old, copied.new),
                                                   sync=copied.target,
                                                   on_result=partial(self._settle, copied)))
        finally:
            for copied in copies[len(futures):]:
                copied.target.unpin()
        await asyncio.gather(*(asyncio.shield(f) for f in futures), return_exceptions=True)

    async def _copy(self, segment: SegmentState, object_id: bytes, old: Location,
                    header: RecordHeader) -> _Copied | None:
        if self._space.location(object_id) != old:
            return None  # deleted (or dropped) while the headers were read
        target, offset = self._space.reserve(old.record_len, header.moved().pack())
        try:
            await self._call(segment.file.copy_record_to, target.file, old.offset, offset, header,
                             pins=(segment, target))
        except RejectedState:
            target.unpin()
            self._drop_corrupt(object_id)
            return None
        except BaseException:
            target.unpin()
            raise
        target.unheaded.pop(offset, None)
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


def read_headers(file: SegmentFile, live: list[tuple[bytes, Location]]) -> list[RecordHeader | RejectedState]:
    """The record header at each location (checked against it), or the rejection instead."""
    out: list[RecordHeader | RejectedState] = []
    for object_id, location in live:
        try:
            header = file.read_record_header(location.offset, object_id, location.generation)
            if header.record_len != location.record_len:
                raise CorruptPayload(f"record holds {header.record_len} bytes, the index says {location.record_len}")
            out.append(header)
        except RejectedState as exc:
            out.append(exc)
    return out
