"""Segment files of the disk tier: the record format and blocking I/O on one file.

``segments/seg-00000001.dat`` … hold records back to back, each at the offset the tier
reserved for it, so a segment can be walked from its start, header to header. A record,
little-endian::

    offset size  field
    0      4     magic b"STRC"
    4      1     record format version (1)
    5      1     flags: bit 0 = the body is an AtRestCipher envelope; bit 1 = a COMMIT
                 record; bit 2 = a VOID record (a reservation never used, skip it)
    6      2     reserved, zero
    8      8     body length in bytes (u64); the record is 64 + body length bytes
    16     16    object_id (the state_id); zero in COMMIT and VOID records
    32     8     object records: generation (u64), 1 when stored, +1 per compaction copy;
                 COMMIT records: the group commit's sequence number
    40     8     COMMIT records: xxh3-64 of the body; zero otherwise
    48     8     reserved, zero
    56     8     checksum: xxh3-64 (u64) of bytes [0, 56) of this record header
    64     …     body: the sealed blob (header + payload), or its at-rest envelope; in a
                 COMMIT record the index ops of one group commit (``tiers.disk.log``)

The checksum guards the record header only; an object body is verified on every read by
its own signature and payload digest (``open_sealed``), or by the AES-GCM tag first.
An object record's header depends only on its reservation, so writing it twice (by the
writer and by a commit that fills the headers below it) writes the same bytes.

- ``RecordHeader``  — ``pack()`` / ``unpack_checked(raw, object_id, generation)`` /
                      ``try_unpack(raw)``; ``commit_header`` / ``void_header``.
- ``SegmentFile``   — one file: lazy open (creating it makes its directory entry durable),
                      ``write_at`` (pwritev), ``sync`` (fdatasync), ``read_record``,
                      ``read_record_header``, ``read_at``, ``walk`` (header to header from
                      the start, resynchronising past a damaged header), ``copy_record_to``,
                      ``unlink``. Every method blocks: the
                      tier calls them in its executor.
- ``segment_path`` / ``list_segments`` — file names and discovery.
"""

from __future__ import annotations

import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import xxhash

from statetier.protocol.errors import CorruptPayload, TruncatedState

RECORD_MAGIC = b"STRC"
RECORD_VERSION = 1
FLAG_ENVELOPE = 0x01
FLAG_COMMIT = 0x02
FLAG_VOID = 0x04
_HEAD = struct.Struct("<4sBBHQ16sQQ8x")
_CHECKSUM = struct.Struct("<Q")
RECORD_HEADER_BYTES = _HEAD.size + _CHECKSUM.size
assert RECORD_HEADER_BYTES == 64

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024
_COPY_CHUNK = 8 << 20
_SCAN_CHUNK = 1 << 20
_NO_OBJECT = bytes(16)
_NAME = re.compile(r"^seg-(\d{8})\.dat$")


@dataclass(frozen=True, slots=True)
class RecordHeader:
    object_id: bytes
    generation: int
    body_len: int
    flags: int = 0
    body_checksum: int = 0  # COMMIT records only

    @property
    def record_len(self) -> int:
        return RECORD_HEADER_BYTES + self.body_len

    @property
    def is_envelope(self) -> bool:
        return bool(self.flags & FLAG_ENVELOPE)

    @property
    def is_commit(self) -> bool:
        return bool(self.flags & FLAG_COMMIT)

    @property
    def is_object(self) -> bool:
        return not self.flags & (FLAG_COMMIT | FLAG_VOID)

    def moved(self) -> "RecordHeader":
        """The header of this object record's next compaction copy."""
        return RecordHeader(self.object_id, self.generation + 1, self.body_len, self.flags)

    def pack(self) -> bytes:
        head = _HEAD.pack(RECORD_MAGIC, RECORD_VERSION, self.flags, 0, self.body_len,
                          self.object_id, self.generation, self.body_checksum)
        return head + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(head))

    @classmethod
    def try_unpack(cls, raw: bytes | bytearray | memoryview) -> "RecordHeader | None":
        """The header in ``raw``, or None where there is none (zeros, a torn or foreign header)."""
        view = memoryview(raw)
        if view.nbytes < RECORD_HEADER_BYTES:
            return None
        magic, version, flags, _res, body_len, oid, gen, body_checksum = _HEAD.unpack_from(view, 0)
        (checksum,) = _CHECKSUM.unpack_from(view, _HEAD.size)
        if magic != RECORD_MAGIC or version != RECORD_VERSION:
            return None
        if checksum != xxhash.xxh3_64_intdigest(view[: _HEAD.size]):
            return None
        return cls(oid, gen, body_len, flags, body_checksum)

    @classmethod
    def unpack_checked(cls, raw: bytes | bytearray | memoryview, object_id: bytes, generation: int) -> "RecordHeader":
        """Parse ``raw`` and insist it is the record of ``object_id`` at ``generation``."""
        if memoryview(raw).nbytes < RECORD_HEADER_BYTES:
            raise TruncatedState("segment ends inside a record header")
        header = cls.try_unpack(raw)
        if header is None:
            raise CorruptPayload("no intact record header at the indexed offset")
        if not header.is_object or header.object_id != object_id or header.generation != generation:
            raise CorruptPayload(f"record at the indexed offset is {header.object_id.hex()} generation "
                                 f"{header.generation}, expected {object_id.hex()} generation {generation}")
        return header


def commit_header(seq: int, body: bytes | memoryview) -> bytes:
    """The header of a COMMIT record holding ``body``."""
    return RecordHeader(_NO_OBJECT, seq, len(body), FLAG_COMMIT, xxhash.xxh3_64_intdigest(body)).pack()


def void_header(record_len: int) -> bytes:
    """The header that marks ``record_len`` reserved bytes as never used."""
    return RecordHeader(_NO_OBJECT, 0, record_len - RECORD_HEADER_BYTES, FLAG_VOID).pack()


def is_commit_body_intact(header: RecordHeader, body: bytes | bytearray | memoryview) -> bool:
    return xxhash.xxh3_64_intdigest(body) == header.body_checksum


def _past(views: list[memoryview], first: int, done: int) -> int:
    """After a vectored read or write of ``done`` bytes from ``views[first:]``: the index of
    the first view not finished, that view trimmed to what is left of it."""
    while first < len(views) and done >= views[first].nbytes:
        done -= views[first].nbytes
        first += 1
    if done:
        views[first] = views[first][done:]
    return first


def segment_path(directory: Path, number: int) -> Path:
    return directory / f"seg-{number:08d}.dat"


def list_segments(directory: Path) -> dict[int, int]:
    """Segment number → file size, for every segment file in ``directory``."""
    found = {}
    for entry in os.scandir(directory):
        match = _NAME.match(entry.name)
        if match and entry.is_file(follow_symlinks=False):
            found[int(match.group(1))] = entry.stat(follow_symlinks=False).st_size
    return found


def sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentFile:
    """One segment file. Writers use disjoint reserved ranges, so no lock guards the I/O."""

    def __init__(self, directory: Path, number: int) -> None:
        self.number = number
        self.path = segment_path(directory, number)
        self._fd: int | None = None
        self._open_lock = threading.Lock()

    def _fd_for_write(self) -> int:
        with self._open_lock:
            if self._fd is None:
                existed = self.path.exists()
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o640)
                if not existed:
                    sync_directory(self.path.parent)
            return self._fd

    def _fd_for_read(self) -> int:
        with self._open_lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR)
            return self._fd

    def write_at(self, offset: int, buffers: Sequence[bytes | bytearray | memoryview]) -> int:
        """Write ``buffers`` back to back from ``offset`` (pwritev, short writes resumed)."""
        fd = self._fd_for_write()
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        total, first = 0, 0
        while first < len(views):
            written = os.pwritev(fd, views[first : first + _IOV_MAX], offset + total)
            total += written
            first = _past(views, first, written)
        return total

    def sync(self) -> None:
        os.fdatasync(self._fd_for_write())

    def read_record_header(self, offset: int, object_id: bytes, generation: int) -> RecordHeader:
        raw = os.pread(self._fd_for_read(), RECORD_HEADER_BYTES, offset)
        return RecordHeader.unpack_checked(raw, object_id, generation)

    def read_at(self, offset: int, nbytes: int) -> bytearray:
        """Exactly ``nbytes`` from ``offset``, or TruncatedState."""
        buffer = bytearray(nbytes)
        self._read_exactly(offset, [memoryview(buffer)])
        return buffer

    def walk(self) -> Iterator[tuple[int, "RecordHeader | None"]]:
        """``(offset, RecordHeader)`` of each record from the start of the file, header to
        header, until the file ends. Where no intact header lies at the expected offset (a
        flipped bit, a torn write) the walk resynchronises: it yields ``(offset, None)``
        for the damaged spot, then goes on at the next intact header found by its magic and
        checksum. Past the last intact header there is only a tail: nothing is yielded."""
        fd = self._fd_for_read()
        size = os.fstat(fd).st_size
        offset = 0
        while offset + RECORD_HEADER_BYTES <= size:
            header = RecordHeader.try_unpack(os.pread(fd, RECORD_HEADER_BYTES, offset))
            if header is None:
                found = self._next_header(fd, offset + 1, size)
                if found is None:
                    return
                yield offset, None
                offset, header = found
            yield offset, header
            offset += header.record_len

    @staticmethod
    def _next_header(fd: int, start: int, size: int) -> tuple[int, "RecordHeader"] | None:
        """The first intact header at or after ``start``; every read moves forward."""
        position = start
        while position + RECORD_HEADER_BYTES <= size:
            chunk = os.pread(fd, _SCAN_CHUNK, position)
            at = chunk.find(RECORD_MAGIC)
            while at != -1 and at + RECORD_HEADER_BYTES <= len(chunk):
                header = RecordHeader.try_unpack(memoryview(chunk)[at : at + RECORD_HEADER_BYTES])
                if header is not None:
                    return position + at, header
                at = chunk.find(RECORD_MAGIC, at + 1)
            if len(chunk) < _SCAN_CHUNK:
                return None
            position += len(chunk) - RECORD_HEADER_BYTES + 1  # a header across the chunk end
        return None

    def read_record(self, offset: int, record_len: int, object_id: bytes, generation: int) -> tuple[RecordHeader, bytearray]:
        """The checked record header and a fresh buffer holding the body."""
        head = bytearray(RECORD_HEADER_BYTES)
        body = bytearray(record_len - RECORD_HEADER_BYTES)
        self._read_exactly(offset, [memoryview(head), memoryview(body)])
        header = RecordHeader.unpack_checked(head, object_id, generation)
        if header.record_len != record_len:
            raise CorruptPayload(f"record holds {header.record_len} bytes, the index says {record_len}")
        return header, body

    def read_record_into(self, offset: int, record_len: int, object_id: bytes, generation: int,
                         body: memoryview) -> RecordHeader:
        """``read_record`` with the body read straight into ``body`` (exactly its length):
        one preadv for header and body, no buffer of its own."""
        if body.nbytes != record_len - RECORD_HEADER_BYTES:
            raise CorruptPayload(f"a {body.nbytes}-byte destination for a {record_len}-byte record")
        head = bytearray(RECORD_HEADER_BYTES)
        self._read_exactly(offset, [memoryview(head), body])
        header = RecordHeader.unpack_checked(head, object_id, generation)
        if header.record_len != record_len:
            raise CorruptPayload(f"record holds {header.record_len} bytes, the index says {record_len}")
        return header

    def advise_willneed(self, offset: int, length: int) -> None:
        """Start reading a range into the page cache: a hint that returns before the reads
        end, so the loop may call it; nothing when the file is not open yet, or on error."""
        if self._fd is None:
            return
        try:
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass  # only a hint: the read itself reports what is wrong

    def _read_exactly(self, offset: int, views: list[memoryview]) -> None:
        fd = self._fd_for_read()
        first = 0
        while first < len(views):
            got = os.preadv(fd, views[first : first + _IOV_MAX], offset)
            if got == 0:
                raise TruncatedState(f"segment {self.number} ends before the record does")
            offset += got
            first = _past(views, first, got)

    def copy_record_to(self, target: "SegmentFile", src_offset: int, dst_offset: int,
                       old: RecordHeader) -> RecordHeader:
        """Copy the record whose header was read as ``old`` to ``target`` at ``dst_offset``,
        as ``old.moved()``; return that header."""
        if self.read_record_header(src_offset, old.object_id, old.generation) != old:
            raise CorruptPayload(f"record {old.object_id.hex()} changed under compaction")
        new = old.moved()
        buffer = bytearray(min(_COPY_CHUNK, max(old.body_len, 1)))
        done = 0
        while done < old.body_len:
            step = min(len(buffer), old.body_len - done)
            view = memoryview(buffer)[:step]
            self._read_exactly(src_offset + RECORD_HEADER_BYTES + done, [view])
            target.write_at(dst_offset + RECORD_HEADER_BYTES + done, [memoryview(buffer)[:step]])
            done += step
        target.write_at(dst_offset, [new.pack()])
        return new

    def close(self) -> None:
        with self._open_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def unlink(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return
        sync_directory(self.path.parent)
