"""Segment files of the disk tier: blocking I/O on one file of records.

``segments/seg-00000001.dat`` … hold records back to back, each at the offset the tier
reserved for it, so a segment can be walked from its start, header to header. The record
header (its layout, and the keyed MACs that bind it to its place) is
``tiers.disk.records``.

- ``SegmentFile(directory, number, codec)`` — one file: lazy open (creating it makes its
  directory entry durable, mode 0600), ``header_bytes`` / ``commit_header`` / ``void_header``
  (packed and authenticated for an offset in this file), ``is_commit_body_intact``,
  ``write_at`` (pwritev), ``sync`` (fdatasync), ``read_record``, ``read_record_into``,
  ``read_record_header``, ``read_at``, ``walk`` (header to header from the start,
  resynchronising past a damaged header), ``copy_record_to``, ``mark_deleted`` (a delete's
  mark over an object's header), ``is_legacy`` (a segment of record format 1),
  ``unknown_first_key``, ``unlink``.
  Every method blocks: the tier calls them in its executor.
- ``segment_path`` / ``list_segments`` — file names and discovery.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Iterator, Sequence

from statetier.protocol.errors import CorruptPayload, TruncatedState
from .records import RECORD_HEADER_BYTES, RECORD_MAGIC, RecordCodec, RecordHeader, is_legacy_header

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024
_COPY_CHUNK = 8 << 20
_SCAN_CHUNK = 1 << 20
_NAME = re.compile(r"^seg-(\d{8})\.dat$")


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

    def __init__(self, directory: Path, number: int, codec: RecordCodec) -> None:
        self.number = number
        self.path = segment_path(directory, number)
        self.codec = codec
        self._fd: int | None = None
        self._open_lock = threading.Lock()

    # -------------------------------------------------------------- headers for this file

    def header_bytes(self, header: RecordHeader, offset: int) -> bytes:
        return self.codec.pack(header, self.number, offset)

    def commit_header(self, seq: int, body: bytes | memoryview, offset: int) -> bytes:
        return self.codec.commit_header(seq, body, self.number, offset)

    def void_header(self, record_len: int, offset: int) -> bytes:
        return self.codec.void_header(record_len, self.number, offset)

    def is_commit_body_intact(self, header: RecordHeader, body: bytes | bytearray | memoryview) -> bool:
        return self.codec.is_commit_body_intact(header, body)

    def _checked(self, raw: bytes | bytearray | memoryview, offset: int, object_id: bytes,
                 generation: int) -> RecordHeader:
        return self.codec.unpack_checked(raw, self.number, offset, object_id, generation)

    # -------------------------------------------------------------- I/O

    def _fd_for_write(self) -> int:
        with self._open_lock:
            if self._fd is None:
                existed = self.path.exists()
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
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
        """The authentic header of ``object_id``'s record at ``offset`` (``is_deleted`` when a
        delete has marked it), or the damage."""
        raw = os.pread(self._fd_for_read(), RECORD_HEADER_BYTES, offset)
        return self._checked(raw, offset, object_id, generation)

    def mark_deleted(self, offset: int, object_id: bytes, generation: int) -> bool:
        """Rewrite the header of ``object_id``'s record at ``offset`` as DELETED (a delete's
        mark, made durable with its COMMIT record): recovery then never takes the record
        back, whatever becomes of that COMMIT record. False when the header there is not the
        intact one of that object (damage has already made it unreadable) or already marked."""
        try:
            header = self.read_record_header(offset, object_id, generation)
        except (CorruptPayload, TruncatedState):
            return False
        if header.is_deleted:
            return False
        self.write_at(offset, [self.header_bytes(header.deleted(), offset)])
        return True

    def unknown_first_key(self) -> bytes | None:
        """The key id of the file's first record when this keyring cannot check it (see
        ``RecordCodec.unknown_key_of``), else None."""
        return self.codec.unknown_key_of(os.pread(self._fd_for_read(), RECORD_HEADER_BYTES, 0))

    def is_legacy(self) -> bool:
        """Whether the file starts with a record of format 1 (written before records were
        authenticated)."""
        return is_legacy_header(os.pread(self._fd_for_read(), RECORD_HEADER_BYTES, 0))

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
            header = self.codec.try_unpack(os.pread(fd, RECORD_HEADER_BYTES, offset), self.number, offset)
            if header is None:
                found = self._next_header(fd, offset + 1, size)
                if found is None:
                    return
                yield offset, None
                offset, header = found
            yield offset, header
            offset += header.record_len

    def _next_header(self, fd: int, start: int, size: int) -> tuple[int, RecordHeader] | None:
        """The first intact header at or after ``start``; every read moves forward."""
        position = start
        while position + RECORD_HEADER_BYTES <= size:
            chunk = os.pread(fd, _SCAN_CHUNK, position)
            at = chunk.find(RECORD_MAGIC)
            while at != -1 and at + RECORD_HEADER_BYTES <= len(chunk):
                header = self.codec.try_unpack(memoryview(chunk)[at : at + RECORD_HEADER_BYTES], self.number,
                                               position + at)
                if header is not None:
                    return position + at, header
                at = chunk.find(RECORD_MAGIC, at + 1)
            if len(chunk) < _SCAN_CHUNK:
                return None
            position += len(chunk) - RECORD_HEADER_BYTES + 1  # a header across the chunk end
        return None

    def read_record(self, offset: int, record_len: int, object_id: bytes,
                    generation: int) -> tuple[RecordHeader, bytearray]:
        """The checked record header and a fresh buffer holding the body."""
        head = bytearray(RECORD_HEADER_BYTES)
        body = bytearray(record_len - RECORD_HEADER_BYTES)
        self._read_exactly(offset, [memoryview(head), memoryview(body)])
        header = self._checked(head, offset, object_id, generation)
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
        header = self._checked(head, offset, object_id, generation)
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
        target.write_at(dst_offset, [target.header_bytes(new, dst_offset)])
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
