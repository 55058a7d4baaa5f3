"""What the disk tier finds on start: the last index checkpoint, caught up with the log.

``recover(index, segment_dir, body) -> Recovered`` blocks; the tier runs it in its executor.

1. Every index entry whose segment file is missing or too short, or whose record header
   (magic, object_id, generation, length, checksum) is not intact at its offset, is
   dropped. A checkpointed entry always points at a durable record, so such an entry
   means damage after the fact; it must never be served.
2. The log is replayed: each segment from the checkpoint's ``scan_from`` on is walked
   header to header, and every intact COMMIT record newer than its ``last_seq`` is applied
   in sequence order (``tiers.disk.log``). For each object only its last op counts: a
   delete removes it (a deleted object never comes back); a put is taken only once its
   record reads back verified (``open_sealed``: signature and digest) — if it does not,
   the op before it counts instead. A record signed under a key id this keyring lacks
   (``UnknownKey``: the daemon restarted with another keyring) is kept: that is no damage,
   and loads refuse it without removing it. A COMMIT record is acknowledged only after it and the
   records it names are durable, so a put that fails here was never acknowledged.
   The walk resynchronises past a damaged header at the next intact one, so one flipped
   bit costs only what it touched: the COMMIT records after it still count, and in a
   segment with such damage (or with a COMMIT record that does not read back) the intact
   object records no intact COMMIT record names are adopted once they read back verified
   (``_adopt_orphans``) — a lost COMMIT record does not lose the intact objects it named.
3. The result is written as a new checkpoint (synced) whose ``scan_from`` is the first
   segment of this run; live bytes per segment are recomputed.
4. Segment files no entry references are deleted, now that no log in them is needed: they
   hold records whose store never completed, records compaction moved, or COMMIT records
   the checkpoint holds. The tier then appends to a fresh segment, never after a tail a
   crash may have torn.

``Recovered``: the surviving entries in created-at order (the LRU order to rebuild), the
sizes of the kept segments, how many entries were dropped, objects re-indexed from the
log (adopted ones included), log puts that did not verify, segments deleted, the first free
segment number, the new checkpoint's ``Mark`` and how many orphan records were adopted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from statetier.protocol.errors import StatetierError, UnknownKey
from statetier.protocol.sealed import open_sealed
from .body import RecordBody
from ..base import ObjectMeta
from .index import Delete, DiskIndex, IndexEntry, IndexOp, Location, Mark, Put
from .log import SegmentLog, scan_log
from .segments import SegmentFile, list_segments

# per object, its logged ops with where each lies in the log: ((commit seq, position), op)
History = dict[bytes, list[tuple[tuple[int, int], IndexOp]]]


@dataclass(frozen=True, slots=True)
class Recovered:
    entries: list[IndexEntry]
    segment_sizes: dict[int, int]
    entries_dropped: int
    replayed: int
    unverified: int
    segments_deleted: int
    next_segment: int
    mark: Mark
    adopted: int = 0


def recover(index: DiskIndex, segment_dir: Path, body: RecordBody) -> Recovered:
    checkpoint = index.mark()
    sizes = list_segments(segment_dir)
    entries, unreadable = index.scan()
    files = {number: SegmentFile(segment_dir, number) for number in sizes}
    state: dict[bytes, IndexEntry] = {}
    dropped = list(unreadable)
    try:
        for entry in entries:
            if _is_intact(entry, sizes, files):
                state[entry.meta.object_id] = entry
            else:
                dropped.append(entry.meta.object_id)
        last_seq, history = checkpoint.last_seq, defaultdict(list)
        logs = {number: scan_log(files[number], checkpoint.last_seq)
                for number in sorted(n for n in sizes if n >= checkpoint.scan_from)}
        for log in logs.values():
            last_seq = max(last_seq, log.highest)
            for seq, ops in log.commits:
                for position, op in enumerate(ops):
                    object_id = op.entry.meta.object_id if isinstance(op, Put) else op.object_id
                    history[object_id].append(((seq, position), op))
        changes, unverified = _replay(state, history, sizes, files, body)
        adopted = _adopt_orphans(state, history, logs, files, body)
        changes += adopted
    finally:
        for file in files.values():
            file.close()
    seen = set(sizes) | {entry.location.segment for entry in entries} | {checkpoint.scan_from - 1}
    next_segment = max(seen, default=0) + 1
    mark = Mark(last_seq, next_segment)
    index.checkpoint([Delete(object_id) for object_id in dropped] + changes, mark)
    kept = list(state.values())
    index.prune_by_key(set(state))
    live: dict[int, int] = {}
    for entry in kept:
        live[entry.location.segment] = live.get(entry.location.segment, 0) + entry.location.record_len
    index.rewrite_live_bytes(live)
    deleted = 0
    for number in sorted(set(sizes) - set(live)):
        files[number].unlink()
        deleted += 1
    kept.sort(key=lambda e: (e.meta.created_at_ns, e.location.segment, e.location.offset))
    return Recovered(kept, {n: sizes[n] for n in live}, len(dropped), len(changes), unverified, deleted,
                     next_segment, mark, len(adopted))


def _replay(state: dict[bytes, IndexEntry], history: History, sizes: dict[int, int],
            files: dict[int, SegmentFile], body: RecordBody) -> tuple[list[IndexOp], int]:
    """Apply each object's last logged op to ``state``; the index ops that do the same."""
    changes: list[IndexOp] = []
    unverified = 0
    for object_id, ops in history.items():
        ops.sort(key=lambda item: item[0])
        final = state.get(object_id)
        for _, op in reversed(ops):
            if isinstance(op, Delete):
                final = None
                break
            assert isinstance(op, Put)  # a COMMIT record holds puts and deletes (log.decode_ops)
            if _reads_back(op.entry, sizes, files, body):
                final = op.entry
                break
            unverified += 1
        if final == state.get(object_id):
            continue
        if final is None:
            del state[object_id]
            changes.append(Delete(object_id))
        else:
            state[object_id] = final
            changes.append(Put(final))
    return changes, unverified


def _adopt_orphans(state: dict[bytes, IndexEntry], history: History, logs: dict[int, SegmentLog],
                   files: dict[int, SegmentFile], body: RecordBody) -> list[IndexOp]:
    """Index the intact object records of damaged segments whose COMMIT record was lost.

    Only in a segment where the walk met damage (a header it had to resynchronise past, or
    a COMMIT record newer than the checkpoint that does not read back) followed by an intact
    COMMIT record: there a lost COMMIT record may have named records that are themselves
    intact. A record is adopted when it is a first store lying before the segment's last
    intact COMMIT record (``SegmentLog.adoptable``), no intact COMMIT record anywhere names
    its object (so no logged delete or newer copy exists), no entry holds it, and it reads
    back verified (signature and digest) as the object its header names.
    """
    named = set().union(*(log.named for log in logs.values())) if logs else set()
    adopted: list[IndexOp] = []
    for number, log in logs.items():
        if not log.is_damaged:
            continue
        for offset, header in log.adoptable():
            object_id = header.object_id
            if object_id in state or object_id in history or object_id in named:
                continue
            location = Location(number, offset, header.record_len, header.generation)
            try:
                blob = body.read_verified(files[number], location, object_id)
                meta = ObjectMeta.from_header(open_sealed(blob, None, body.keyring, verify_payload=False).header)
            except (StatetierError, OSError):
                continue
            entry = IndexEntry(location, meta)
            state[object_id] = entry
            adopted.append(Put(entry))
    return adopted


def _reads_back(entry: IndexEntry, sizes: dict[int, int], files: dict[int, SegmentFile], body: RecordBody) -> bool:
    loc = entry.location
    if not _is_intact(entry, sizes, files):
        return False
    try:
        body.read_verified(files[loc.segment], loc, entry.meta.object_id)
    except UnknownKey:
        return True  # intact and committed, signed under a key this keyring lacks: kept, refused on load
    except (StatetierError, OSError):
        return False
    return True


def _is_intact(entry: IndexEntry, sizes: dict[int, int], files: dict[int, SegmentFile]) -> bool:
    loc = entry.location
    size = sizes.get(loc.segment)
    if size is None or loc.offset + loc.record_len > size:
        return False
    try:
        header = files[loc.segment].read_record_header(loc.offset, entry.meta.object_id, loc.generation)
    except StatetierError:
        return False
    return header.record_len == loc.record_len
