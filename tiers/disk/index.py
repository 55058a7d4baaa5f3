"""The disk tier's LMDB index: where each object's record lives, and what the object is.

The index is a *checkpoint* of the log the segments hold (``tiers.disk.log``): it is
written in the background every so many commits, in one durable transaction, and says up
to which group commit (``last_seq``) it is complete and from which segment (``scan_from``)
a restart must read the log to catch up. One environment (``index/``, synced) with four
named databases:

- ``objects``:  object_id (16 B) → entry, little-endian: format u8 (2), segment u32,
  offset u64, record_len u64, generation u64, kind u8 (bit 7: a speculative snapshot),
  version u64, size u64,
  header_len u32, created_at_ns u64, step u64, key_digest_len u8, stream_id_len u8,
  request_id_len u8, namespace_len u8, tenant_len u8, then the key_digest, stream_id,
  request_id (UTF-8), namespace and tenant (UTF-8) bytes. Format 1 (before namespace and
  tenant were recorded) lacks the last two lengths and fields: it reads as an entry whose
  namespace and tenant are unknown (b"", "").
- ``by_key``:   key_digest_len u8 + key_digest + object_id → b"" (``find_by_key`` scans
  the prefix).
- ``segments``: segment number (u32 big-endian, so keys sort) → live record bytes u64.
- ``meta``:     b"last_seq" and b"scan_from" → u64 (``Mark``).

- ``Location`` / ``IndexEntry``   — value objects, packed and unpacked here.
- ``Put`` / ``Move`` / ``Delete`` — index operations; ``DiskIndex.apply(ops)`` runs a batch
  in order in one write transaction and returns, per op, whether it took effect
  (``Move`` applies only while the entry is still at its old location).
- ``DiskIndex`` — ``open``, ``apply``, ``checkpoint(ops, mark)``, ``mark``, ``scan``, ``drop``,
  ``prune_by_key``, ``object_ids_for_key``, ``rewrite_live_bytes``, ``live_bytes``, ``close``.
  Every method blocks: the tier runs them in its executor.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
import lmdb

from statetier.protocol.identity import Kind
from ..base import ObjectMeta

_ENTRY_V1 = struct.Struct("<BIQQQBQQIQQBBB")
_ENTRY = struct.Struct("<BIQQQBQQIQQBBBBB")
_ENTRY_FORMAT = 2
_SPECULATIVE = 0x80  # high bit of the kind byte: the object is a speculative snapshot
_SEGMENT_KEY = struct.Struct(">I")
_LIVE = struct.Struct("<Q")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Mark:
    """How far a checkpoint reaches: every group commit up to ``last_seq`` is in it, and
    the log of any later one lies in segments numbered ``scan_from`` or higher."""

    last_seq: int = 0
    scan_from: int = 1


@dataclass(frozen=True, slots=True)
class Location:
    """Where one generation of an object's record lies."""

    segment: int
    offset: int
    record_len: int
    generation: int


@dataclass(frozen=True, slots=True)
class IndexEntry:
    location: Location
    meta: ObjectMeta

    def pack(self) -> bytes:
        loc, meta = self.location, self.meta
        request_id, tenant = meta.request_id.encode(), meta.tenant.encode()
        kind = int(meta.kind) | (_SPECULATIVE if meta.speculative else 0)
        return _ENTRY.pack(_ENTRY_FORMAT, loc.segment, loc.offset, loc.record_len, loc.generation,
                           kind, meta.version, meta.size, meta.header_len, meta.created_at_ns,
                           meta.step, len(meta.key_digest), len(meta.stream_id), len(request_id),
                           len(meta.namespace), len(tenant)
                           ) + meta.key_digest + meta.stream_id + request_id + meta.namespace + tenant

    @classmethod
    def unpack(cls, object_id: bytes, raw: bytes | bytearray | memoryview) -> "IndexEntry":
        raw = bytes(raw)
        fmt = raw[0] if raw else 0
        if fmt == _ENTRY_FORMAT:
            fixed, *fields = _ENTRY.size, *_ENTRY.unpack_from(raw, 0)
        elif fmt == 1:
            fixed, *fields = _ENTRY_V1.size, *_ENTRY_V1.unpack_from(raw, 0), 0, 0
        else:
            raise ValueError(f"index entry format {fmt}")
        (_, segment, offset, record_len, generation, kind, version, size, header_len, created, step,
         key_len, stream_len, request_len, namespace_len, tenant_len) = fields
        if len(raw) != fixed + key_len + stream_len + request_len + namespace_len + tenant_len:
            raise ValueError("index entry length does not match its fields")
        key_end = fixed + key_len
        stream_end = key_end + stream_len
        request_end = stream_end + request_len
        namespace_end = request_end + namespace_len
        meta = ObjectMeta(bytes(object_id), raw[fixed:key_end], raw[key_end:stream_end], version,
                          Kind(kind & ~_SPECULATIVE), size, header_len, created, raw[stream_end:request_end].decode(),
                          step, bool(kind & _SPECULATIVE), raw[request_end:namespace_end], raw[namespace_end:].decode())
        return cls(Location(segment, offset, record_len, generation), meta)


def _by_key(key_digest: bytes, object_id: bytes) -> bytes:
    return bytes([len(key_digest)]) + key_digest + object_id


@dataclass(frozen=True, slots=True)
class Put:
    entry: IndexEntry


@dataclass(frozen=True, slots=True)
class Move:
    object_id: bytes
    old: Location
    new: Location


@dataclass(frozen=True, slots=True)
class Delete:
    object_id: bytes


IndexOp = Put | Move | Delete


class DiskIndex:
    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env
        self._objects = env.open_db(b"objects")
        self._by_key_db = env.open_db(b"by_key")
        self._segments = env.open_db(b"segments")
        self._meta = env.open_db(b"meta")

    @classmethod
    def open(cls, path: Path, map_size: int, sync: bool = True) -> "DiskIndex":
        env = lmdb.open(str(path), subdir=True, map_size=map_size, max_dbs=4, sync=sync,
                        metasync=sync, readahead=False, meminit=False)
        return cls(env)

    def close(self) -> None:
        self._env.close()

    def apply(self, ops: list[IndexOp]) -> list[bool]:
        """Apply ``ops`` in order, in one durable transaction."""
        with self._env.begin(write=True) as txn:
            return self._apply(txn, ops)

    def checkpoint(self, ops: list[IndexOp], mark: Mark) -> None:
        """Apply ``ops`` in order and record ``mark``, in one durable transaction."""
        with self._env.begin(write=True) as txn:
            self._apply(txn, ops)
            txn.put(b"last_seq", _U64.pack(mark.last_seq), db=self._meta)
            txn.put(b"scan_from", _U64.pack(mark.scan_from), db=self._meta)

    def mark(self) -> Mark:
        """The last checkpoint's mark (``Mark()`` for an index that never had one)."""
        with self._env.begin() as txn:
            last_seq, scan_from = txn.get(b"last_seq", db=self._meta), txn.get(b"scan_from", db=self._meta)
        if last_seq is None or scan_from is None:
            return Mark()
        return Mark(_U64.unpack(last_seq)[0], _U64.unpack(scan_from)[0])

    def _apply(self, txn: lmdb.Transaction, ops: list[IndexOp]) -> list[bool]:
        live_delta: dict[int, int] = defaultdict(int)
        results = [self._apply_one(txn, op, live_delta) for op in ops]
        for segment, delta in live_delta.items():
            if delta:
                key = _SEGMENT_KEY.pack(segment)
                raw = txn.get(key, db=self._segments)
                live = (_LIVE.unpack(raw)[0] if raw else 0) + delta
                if live > 0:
                    txn.put(key, _LIVE.pack(live), db=self._segments)
                else:
                    txn.delete(key, db=self._segments)
        return results

    def _apply_one(self, txn: lmdb.Transaction, op: IndexOp, live_delta: dict[int, int]) -> bool:
        if isinstance(op, Put):
            self._forget(txn, op.entry.meta.object_id, live_delta)
            meta, loc = op.entry.meta, op.entry.location
            txn.put(meta.object_id, op.entry.pack(), db=self._objects)
            txn.put(_by_key(meta.key_digest, meta.object_id), b"", db=self._by_key_db)
            live_delta[loc.segment] += loc.record_len
            return True
        if isinstance(op, Move):
            raw = txn.get(op.object_id, db=self._objects)
            if raw is None:
                return False
            entry = IndexEntry.unpack(op.object_id, raw)
            if entry.location != op.old:
                return False
            txn.put(op.object_id, IndexEntry(op.new, entry.meta).pack(), db=self._objects)
            live_delta[op.old.segment] -= op.old.record_len
            live_delta[op.new.segment] += op.new.record_len
            return True
        return self._forget(txn, op.object_id, live_delta)

    def _forget(self, txn: lmdb.Transaction, object_id: bytes, live_delta: dict[int, int]) -> bool:
        raw = txn.get(object_id, db=self._objects)
        if raw is None:
            return False
        txn.delete(object_id, db=self._objects)
        try:
            entry = IndexEntry.unpack(object_id, raw)
        except (struct.error, ValueError):
            return True  # an unreadable entry; ``prune_by_key`` clears what it left behind
        txn.delete(_by_key(entry.meta.key_digest, object_id), db=self._by_key_db)
        live_delta[entry.location.segment] -= entry.location.record_len
        return True

    def scan(self) -> tuple[list[IndexEntry], list[bytes]]:
        """Every entry, and the ids of entries that do not parse (to be dropped)."""
        entries, unreadable = [], []
        with self._env.begin() as txn:
            for object_id, raw in txn.cursor(db=self._objects):
                try:
                    entries.append(IndexEntry.unpack(object_id, raw))
                except (struct.error, ValueError):
                    unreadable.append(bytes(object_id))
        return entries, unreadable

    def object_ids_for_key(self, key_digest: bytes) -> list[bytes]:
        prefix = bytes([len(key_digest)]) + key_digest
        found = []
        with self._env.begin() as txn:
            cursor = txn.cursor(db=self._by_key_db)
            if cursor.set_range(prefix):
                for key in cursor.iternext(keys=True, values=False):
                    if not key.startswith(prefix):
                        break
                    if len(key) == len(prefix) + 16:
                        found.append(bytes(key[len(prefix):]))
        return found

    def drop(self, object_ids: list[bytes]) -> None:
        if object_ids:
            self.apply([Delete(object_id) for object_id in object_ids])

    def prune_by_key(self, valid: set[bytes]) -> int:
        """Delete ``by_key`` rows whose object is not in ``valid``; return how many."""
        with self._env.begin(write=True) as txn:
            stale = [bytes(key) for key in txn.cursor(db=self._by_key_db).iternext(values=False)
                     if bytes(key[-16:]) not in valid]
            for key in stale:
                txn.delete(key, db=self._by_key_db)
        return len(stale)

    def rewrite_live_bytes(self, live: dict[int, int]) -> None:
        """Replace the ``segments`` table with ``live`` (recomputed at start)."""
        with self._env.begin(write=True) as txn:
            txn.drop(self._segments, delete=False)
            for segment, nbytes in sorted(live.items()):
                if nbytes > 0:
                    txn.put(_SEGMENT_KEY.pack(segment), _LIVE.pack(nbytes), db=self._segments)

    def live_bytes(self) -> dict[int, int]:
        with self._env.begin() as txn:
            return {_SEGMENT_KEY.unpack(k)[0]: _LIVE.unpack(v)[0]
                    for k, v in txn.cursor(db=self._segments)}
