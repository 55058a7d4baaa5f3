"""Where the disk tier's records are, in memory: segments, reservations and placements.

- ``SegmentState`` — one segment: its ``SegmentFile``; ``tail`` (bytes reserved or on
  disk); ``live_bytes`` and ``objects`` (records the index points at); ``lingering`` (ids
  whose readers may still hold a location in this segment although the index moved or
  dropped it); ``pins`` (reservations and I/O in flight); ``unheaded`` (offset → header
  of each reservation whose header may not be written yet: the next COMMIT record in
  this segment fills those below it, ``tiers.disk.log``). ``is_deletable`` says whether
  the file may go: nothing live, nothing pinned, no lingering id (after
  ``forget_unleased`` dropped those no lease holds any more).
- ``SegmentSpace`` — the segments by number and the one ``active`` segment;
  ``reserve(record_len, header)`` assigns an offset (and a pin) in the active segment
  (``header`` is a ``RecordHeader``, authenticated for that offset),
  sealing it and opening the next once it passes ``segment_bytes``; ``reserve_log`` does
  the same for a COMMIT record but never seals (it belongs beside the records it names);
  ``retire_active`` seals the active segment early; ``place`` / ``unplace`` /
  ``location`` track each object's current record; ``holds(segment)``;
  ``compaction_candidates(ratio)``.

Nothing here blocks or awaits: the tier calls it from the event loop, so a reservation
or a placement is atomic with respect to other coroutines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .index import Location
from .records import RecordCodec, RecordHeader
from .segments import SegmentFile


class SegmentState:
    def __init__(self, file: SegmentFile, tail: int = 0) -> None:
        self.file = file
        self.number = file.number
        self.tail = tail
        self.live_bytes = 0
        self.objects: set[bytes] = set()
        self.lingering: set[bytes] = set()
        self.pins = 0
        self.unheaded: dict[int, bytes] = {}
        self.moved_out_bytes = 0  # live bytes compaction copied elsewhere
        self.is_drained = False  # compaction moved every live record out of it

    @property
    def live_ratio(self) -> float:
        return self.live_bytes / self.tail if self.tail else 0.0

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1
        assert self.pins >= 0, "segment unpinned more often than pinned"

    def forget_unleased(self, is_leased: Callable[[bytes], bool]) -> None:
        """Drop lingering ids no lease holds: new leases only get current locations."""
        self.lingering = {object_id for object_id in self.lingering if is_leased(object_id)}

    @property
    def is_deletable(self) -> bool:
        return not (self.pins or self.objects or self.lingering)


class SegmentSpace:
    def __init__(self, directory: Path, segment_bytes: int, first_active: int, codec: RecordCodec) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.codec = codec
        self.segments: dict[int, SegmentState] = {}
        self._locations: dict[bytes, Location] = {}
        self._next_number = first_active
        self.active = self._open_next()

    def _open_next(self) -> SegmentState:
        state = SegmentState(SegmentFile(self.directory, self._next_number, self.codec))
        self.segments[state.number] = state
        self._next_number += 1
        return state

    def adopt(self, number: int, size: int) -> SegmentState:
        """A sealed segment found on disk at start."""
        state = SegmentState(SegmentFile(self.directory, number, self.codec), size)
        self.segments[number] = state
        return state

    def reserve(self, record_len: int, header: RecordHeader) -> tuple[SegmentState, int]:
        """Room for one object record in the active segment, whose header will be
        ``header``; the caller owns one pin on the segment."""
        if self.active.tail and self.active.tail + record_len > self.segment_bytes:
            self.active = self._open_next()
        segment, offset = self.reserve_log(record_len)
        segment.unheaded[offset] = segment.file.header_bytes(header, offset)
        return segment, offset

    def reserve_log(self, record_len: int) -> tuple[SegmentState, int]:
        """Room for a COMMIT record at the end of the active segment, however full; pinned."""
        segment, offset = self.active, self.active.tail
        segment.tail += record_len
        segment.pin()
        return segment, offset

    def retire_active(self) -> None:
        self.active = self._open_next()

    def place(self, object_id: bytes, location: Location) -> None:
        self.unplace(object_id)
        segment = self.segments[location.segment]
        segment.objects.add(object_id)
        segment.live_bytes += location.record_len
        self._locations[object_id] = location

    def unplace(self, object_id: bytes) -> Location | None:
        location = self._locations.pop(object_id, None)
        if location is not None:
            segment = self.segments[location.segment]
            segment.objects.discard(object_id)
            segment.live_bytes -= location.record_len
        return location

    def holds(self, segment: SegmentState) -> bool:
        """Whether ``segment`` is still one of the tier's (compaction has not forgotten it)."""
        return self.segments.get(segment.number) is segment

    def location(self, object_id: bytes) -> Location | None:
        return self._locations.get(object_id)

    def segment_of(self, location: Location) -> SegmentState:
        return self.segments[location.segment]

    def compaction_candidates(self, below_ratio: float) -> list[SegmentState]:
        """Sealed, unpinned segments whose live ratio is under ``below_ratio``, sparsest first."""
        found = [s for s in self.segments.values()
                 if s is not self.active and not s.pins and not s.is_drained and s.live_ratio < below_ratio]
        return sorted(found, key=lambda s: (s.live_ratio, s.number))

    def drained(self) -> list[SegmentState]:
        return [s for s in self.segments.values() if s.is_drained]

    def forget(self, segment: SegmentState) -> None:
        del self.segments[segment.number]

    @property
    def disk_bytes(self) -> int:
        return sum(s.tail for s in self.segments.values())

    @property
    def live_record_bytes(self) -> int:
        return sum(s.live_bytes for s in self.segments.values())
