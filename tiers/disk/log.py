"""The disk tier's log: each group commit is one COMMIT record in a segment, made durable
with the records it names by one fdatasync.

The segments are the log and the LMDB index a checkpoint of it (``tiers.disk.checkpoint``).
A store is durable once its object record and the COMMIT record naming it have been
fdatasync'd together; the index learns of it later, in the background, and a restart
that finds the index behind replays the COMMIT records it lacks (``tiers.disk.recovery``).

- ``CommitLog.flush(batch)`` — ``GroupCommit``'s flush, on the event loop: resolves each
  op (a ``Move`` whose object left its old location has no effect), reserves the COMMIT
  record in the active segment and runs ``write_batch`` in the executor. Ops that reached
  the log go to the checkpointer. If the COMMIT record could not be written (a full disk)
  the batch is made durable by a synchronous checkpoint instead, so deletes still work.
- ``write_batch(plan)`` — blocking: writes the buffered object records of the batch, fills
  every header still missing below the COMMIT record (so a restart can walk the segment
  header to header up to it), writes the COMMIT record and fdatasyncs each segment once.
- ``encode_ops`` / ``decode_ops`` — the COMMIT body: u32 op count, then per op u8 kind
  (1 put, 2 delete), the 16-byte object_id and, for a put, u16 length + the packed
  ``IndexEntry``; zero padding to the reserved length.
- ``scan_log(file, after_seq)`` → ``SegmentLog`` — blocking: one segment walked header to
  header (resynchronising past a damaged header): its intact COMMIT records newer than
  ``after_seq``, the object ids every intact COMMIT record names, its intact object
  records, and whether it is damaged. ``read_commits`` returns only the first part.

Why one fdatasync is enough: before a COMMIT record is acknowledged every reservation
below it in its segment has a header in the page cache (written by its writer or filled
here, always the same bytes), and the fdatasync makes all of it durable at once. A torn
tail after a power cut can only hide COMMIT records whose fdatasync had not returned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from statetier.protocol.errors import StatetierError
from .checkpoint import Checkpointer
from .commit import PendingOp, RecordWrite
from .index import Delete, IndexEntry, IndexOp, Put
from .jobs import chained
from .space import SegmentSpace, SegmentState
from .segments import (
    RECORD_HEADER_BYTES, RecordHeader, SegmentFile, commit_header, is_commit_body_intact, void_header,
)

_COUNT = struct.Struct("<I")
_PUT, _DELETE = 1, 2
_ENTRY_LEN = struct.Struct("<H")


def encoded_len(ops: list[IndexOp]) -> int:
    return _COUNT.size + sum(17 + (_ENTRY_LEN.size + len(op.entry.pack()) if isinstance(op, Put) else 0)
                             for op in ops)


def encode_ops(ops: list[IndexOp], body_len: int) -> bytes:
    """The COMMIT body for ``ops`` (puts and deletes), zero-padded to ``body_len``."""
    parts = [_COUNT.pack(len(ops))]
    for op in ops:
        if isinstance(op, Put):
            packed = op.entry.pack()
            parts += [bytes([_PUT]), op.entry.meta.object_id, _ENTRY_LEN.pack(len(packed)), packed]
        else:
            parts += [bytes([_DELETE]), op.object_id]
    body = b"".join(parts)
    if len(body) > body_len:
        raise ValueError("the COMMIT body outgrew its reservation")
    return body + bytes(body_len - len(body))


def decode_ops(body: bytes | bytearray | memoryview) -> list[IndexOp]:
    view = memoryview(body)
    (count,) = _COUNT.unpack_from(view, 0)
    pos, ops = _COUNT.size, list[IndexOp]()
    for _ in range(count):
        kind, object_id = view[pos], bytes(view[pos + 1 : pos + 17])
        pos += 17
        if kind == _PUT:
            (length,) = _ENTRY_LEN.unpack_from(view, pos)
            ops.append(Put(IndexEntry.unpack(object_id, view[pos + 2 : pos + 2 + length])))
            pos += 2 + length
        elif kind == _DELETE:
            ops.append(Delete(object_id))
        else:
            raise ValueError(f"COMMIT op kind {kind}")
    return ops


@dataclass(slots=True)
class SegmentLog:
    """What ``scan_log`` found in one segment."""

    commits: list[tuple[int, list[IndexOp]]] = field(default_factory=list)  # newer than after_seq
    highest: int = 0  # the highest sequence number of any COMMIT record found
    named: set[bytes] = field(default_factory=set)  # object ids any intact COMMIT record names
    objects: list[tuple[int, RecordHeader]] = field(default_factory=list)  # intact object records
    damage_at: list[int] = field(default_factory=list)  # damaged headers; COMMIT records newer than
    #                                                      after_seq that do not read back
    last_commit_at: int = -1  # offset of the last intact COMMIT record

    @property
    def is_damaged(self) -> bool:
        """Damage the log went on past: an intact COMMIT record follows it. A damaged spot
        after the last one is a torn tail (a crash in the middle of a store), not damage."""
        return any(offset < self.last_commit_at for offset in self.damage_at)

    def adoptable(self) -> list[tuple[int, RecordHeader]]:
        """First stores (generation 1: a compaction copy no COMMIT names is one whose move had
        no effect, its object deleted) lying before the last intact COMMIT record, which was
        only written once everything before it in the segment was durable."""
        return [(offset, header) for offset, header in self.objects
                if header.generation == 1 and offset < self.last_commit_at]


def scan_log(file: SegmentFile, after_seq: int) -> SegmentLog:
    """Walk one segment (resynchronising past damage): its intact COMMIT records newer than
    ``after_seq`` in file order, what every intact COMMIT record names, and its intact
    object records — the candidates recovery adopts where the COMMIT naming them is lost."""
    found = SegmentLog()
    for offset, header in file.walk():
        if header is None:
            found.damage_at.append(offset)
            continue
        if header.is_object:
            found.objects.append((offset, header))
            continue
        if not header.is_commit:
            continue
        found.highest = max(found.highest, header.generation)
        try:
            body = file.read_at(offset + RECORD_HEADER_BYTES, header.body_len)
        except StatetierError:
            break  # the file ends inside it: a torn tail
        ops = _intact_ops(header, body)
        if ops is None:
            if header.generation > after_seq:
                found.damage_at.append(offset)
            continue
        found.last_commit_at = offset
        found.named.update(op.entry.meta.object_id if isinstance(op, Put) else op.object_id for op in ops)
        if header.generation > after_seq:
            found.commits.append((header.generation, ops))
    return found


def read_commits(file: SegmentFile, after_seq: int) -> tuple[list[tuple[int, list[IndexOp]]], int]:
    """``[(seq, ops)]`` of the intact COMMIT records newer than ``after_seq``, and the
    highest sequence number of any COMMIT record found."""
    found = scan_log(file, after_seq)
    return found.commits, found.highest


def _intact_ops(header: RecordHeader, body: bytes | bytearray | memoryview) -> list[IndexOp] | None:
    if not is_commit_body_intact(header, body):
        return None
    try:
        return decode_ops(body)
    except (struct.error, ValueError, IndexError):
        return None


# ---------------------------------------------------------------------------- the batch job


@dataclass(frozen=True, slots=True)
class BatchPlan:
    seq: int
    commit_file: SegmentFile
    commit_offset: int
    commit_len: int
    ops: list[tuple[IndexOp | None, RecordWrite | None]]  # None: an op with no effect
    fills: list[tuple[int, bytes]]  # (offset, header) in the commit segment
    syncs: list[SegmentFile]
    fsync: bool


@dataclass(slots=True)
class BatchOutcome:
    record_errors: dict[int, BaseException] = field(default_factory=dict)  # by op position
    filled: bool = False
    commit_written: bool = False
    log_error: BaseException | None = None
    sync_error: BaseException | None = None


def write_batch(plan: BatchPlan) -> BatchOutcome:
    out = BatchOutcome()
    for position, (_op, record) in enumerate(plan.ops):
        if record is not None:
            try:
                record.write()
            except Exception as exc:
                out.record_errors[position] = exc
    logged = [op for position, (op, _) in enumerate(plan.ops)
              if op is not None and position not in out.record_errors]
    written_here = {record.offset for position, (_, record) in enumerate(plan.ops)
                    if record is not None and position not in out.record_errors
                    and record.segment.file is plan.commit_file}
    try:
        for offset, header in plan.fills:
            if offset not in written_here:
                plan.commit_file.write_at(offset, [header])
        out.filled = True
        body = encode_ops(logged, plan.commit_len - RECORD_HEADER_BYTES)
        plan.commit_file.write_at(plan.commit_offset, [commit_header(plan.seq, body), body])
        out.commit_written = True
    except Exception as exc:
        out.log_error = exc
    if plan.fsync:
        for segment in plan.syncs:
            try:
                segment.sync()
            except OSError as exc:
                out.sync_error = out.sync_error or exc
    return out


# ---------------------------------------------------------------------------- on the loop


class CommitLog:
    def __init__(self, space: SegmentSpace, call: Callable[..., Awaitable[Any]], checkpointer: Checkpointer,
                 resolve: Callable[[IndexOp], IndexOp | None], fsync: bool, next_seq: int) -> None:
        self._space = space
        self._call = call
        self._checkpointer = checkpointer
        self._resolve = resolve
        self._fsync = fsync
        self.next_seq = next_seq
        self.inflight_segment: int | None = None  # where the COMMIT record in flight lies
        self.commit_bytes = 0
        self.fallbacks = 0

    async def flush(self, batch: list[PendingOp]) -> list[object]:
        resolved = [self._resolve(pending.op) for pending in batch]
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        commit_len = RECORD_HEADER_BYTES + encoded_len([op for op in resolved if op is not None])
        segment, offset = self._space.reserve_log(commit_len)
        self.commit_bytes += commit_len
        fills = sorted((o, h) for o, h in segment.unheaded.items() if o < offset)
        syncs = {id(p.sync): p.sync for p in batch if p.sync is not None}
        syncs[id(segment)] = segment
        plan = BatchPlan(seq, segment.file, offset, commit_len, [(op, p.record) for op, p in zip(resolved, batch)],
                         fills, [s.file for s in syncs.values()], self._fsync)
        self.inflight_segment = segment.number
        try:
            outcome = await self._call(write_batch, plan, pins=tuple(syncs.values()))
        except BaseException:
            self._space.retire_active()  # the job's fate is unknown: no later COMMIT goes here
            raise
        finally:
            self.inflight_segment = None
            segment.unpin()
        self._note_headers(batch, segment, offset, commit_len, fills, outcome)
        return await self._settle(resolved, seq, outcome)

    def _note_headers(self, batch: list[PendingOp], segment: SegmentState, offset: int, commit_len: int,
                      fills: list[tuple[int, bytes]], outcome: BatchOutcome) -> None:
        for position, pending in enumerate(batch):
            if pending.record is not None and position not in outcome.record_errors:
                pending.record.segment.unheaded.pop(pending.record.offset, None)
        if outcome.filled:
            for fill_offset, _ in fills:
                segment.unheaded.pop(fill_offset, None)
        if not outcome.commit_written:
            segment.unheaded[offset] = void_header(commit_len)

    async def _settle(self, resolved: list[IndexOp | None], seq: int, outcome: BatchOutcome) -> list[object]:
        if outcome.sync_error is not None:
            return [chained(outcome.sync_error)] * len(resolved)
        logged = [op for position, op in enumerate(resolved)
                  if op is not None and position not in outcome.record_errors]
        if outcome.log_error is None:
            self._checkpointer.note(logged, seq)
        else:  # nothing of this batch is in the log: the index takes it, durably, now
            try:
                await self._checkpointer.write_through(logged, seq)
            except StatetierError as exc:
                error = chained(outcome.log_error)
                error.__context__ = exc
                return [error] * len(resolved)
            self.fallbacks += 1
        return [chained(outcome.record_errors[position]) if position in outcome.record_errors
                else op is not None for position, op in enumerate(resolved)]
