"""What the disk tier finds on start: the LMDB index checked against the segment files.

``recover(index, segment_dir) -> Recovered`` blocks; the tier runs it in its executor.

1. Every index entry whose segment file is missing or too short, or whose record header
   (magic, object_id, generation, length, checksum) is not intact at its offset, is
   dropped. A committed entry always points at a durable record, so such an entry means
   damage after the fact; it must never be served.
2. Live bytes per segment are recomputed from the surviving entries and written back.
3. Segment files no entry references are deleted: they hold only records whose store
   never completed, or records compaction had already moved. The tier then appends to a
   fresh segment, never after a tail a crash may have torn.

``Recovered``: the surviving entries in created-at order (the LRU order to rebuild),
the sizes of the kept segments, how many entries were dropped and segments deleted,
and the first free segment number.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from statetier.protocol.errors import RejectedState
from statetier.tiers.disk_index import DiskIndex, IndexEntry
from statetier.tiers.segments import SegmentFile, list_segments


@dataclass(frozen=True, slots=True)
class Recovered:
    entries: list[IndexEntry]
    segment_sizes: dict[int, int]
    entries_dropped: int
    segments_deleted: int
    next_segment: int


def recover(index: DiskIndex, segment_dir: Path) -> Recovered:
    sizes = list_segments(segment_dir)
    entries, unreadable = index.scan()
    files = {number: SegmentFile(segment_dir, number) for number in sizes}
    kept, dropped = [], list(unreadable)
    try:
        for entry in entries:
            if _is_intact(entry, sizes, files):
                kept.append(entry)
            else:
                dropped.append(entry.meta.object_id)
    finally:
        for file in files.values():
            file.close()
    index.drop(dropped)
    index.prune_by_key({entry.meta.object_id for entry in kept})
    live: dict[int, int] = {}
    for entry in kept:
        live[entry.location.segment] = live.get(entry.location.segment, 0) + entry.location.record_len
    index.rewrite_live_bytes(live)
    deleted = 0
    for number in sorted(set(sizes) - set(live)):
        files[number].unlink()
        deleted += 1
    kept.sort(key=lambda e: (e.meta.created_at_ns, e.location.segment, e.location.offset))
    seen = set(sizes) | {entry.location.segment for entry in entries}
    return Recovered(kept, {n: sizes[n] for n in live}, len(dropped), deleted, max(seen, default=0) + 1)


def _is_intact(entry: IndexEntry, sizes: dict[int, int], files: dict[int, SegmentFile]) -> bool:
    loc = entry.location
    size = sizes.get(loc.segment)
    if size is None or loc.offset + loc.record_len > size:
        return False
    try:
        header = files[loc.segment].read_record_header(loc.offset, entry.meta.object_id, loc.generation)
    except RejectedState:
        return False
    return header.record_len == loc.record_len
