"""The disk tier's record header: its fields, its byte layout, and the keyed MACs that let
recovery believe only records written by a holder of the keyring.

A record in a segment file (``tiers.disk.segments``), little-endian::

    offset size  field
    0      4     magic b"STRC"
    4      1     record format version (2)
    5      1     flags: bit 0 = the body is an AtRestCipher envelope; bit 1 = a COMMIT
                 record; bit 2 = a VOID record (a reservation never used, skip it);
                 bit 3 = DELETED (an object record whose object was deleted: the delete
                 rewrites the header in place, in the same fdatasync as its COMMIT record)
    6      2     reserved, zero
    8      8     body length in bytes (u64); the record is 64 + body length bytes
    16     16    object_id (the state_id); zero in COMMIT and VOID records
    32     8     object records: generation (u64), 1 when stored, +1 per compaction copy;
                 COMMIT records: the group commit's sequence number
    40     8     id of the keyring key whose record key authenticates this record
    48     8     COMMIT records: MAC of the body; zero otherwise
    56     8     MAC of bytes [0, 56) of this header, the segment's number (u32) and the
                 record's offset in it (u64)
    64     …     body: the sealed blob (header + payload), or its at-rest envelope; in a
                 COMMIT record the index ops of one group commit (``tiers.disk.log``)

The MACs are 8 bytes of keyed BLAKE3 under a *record key* derived from a keyring key's
secret (the HMAC cluster secret or the Ed25519 seed) under its own context: never the
signing key itself. A record no holder of the keyring wrote, or one copied to another
place, does not read as a record, so recovery skips it as damage. An object body is
verified on every read by its own signature and payload digest, or the AES-GCM tag first.
Records of a key past its grace (``Keyring.get_for_verify``) read as damage, as the objects
it signed do.

Format 1 (before the MACs: an unkeyed xxh3-64 checksum at 56, the COMMIT body's xxh3-64 at
40) is never read as a record; ``is_legacy_header`` recognises one, so recovery can set its
segment aside with a reason (``tiers.disk.recovery``).

- ``RecordHeader`` — the fields; ``moved()`` (the next compaction copy), ``deleted()``.
- ``RecordCodec(keyring)`` — ``pack(header, segment, offset)``, ``commit_header(seq, body,
  segment, offset)``, ``void_header(record_len, segment, offset)``, ``try_unpack(raw,
  segment, offset)`` (None where no authentic header lies), ``unpack_checked(raw, segment,
  offset, object_id, generation)``, ``is_commit_body_intact(header, body)``,
  ``unknown_key_of(raw)`` (a header this keyring cannot check: not damage). A trust store
  holding only public keys cannot make a record key: ``ConfigError`` at the first write.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass, replace

import blake3
import xxhash

from statetier.protocol.errors import ConfigError, CorruptPayload, TruncatedState
from statetier.protocol.keyring import KEY_ID_BYTES, Keyring

RECORD_MAGIC = b"STRC"
RECORD_VERSION = 2
LEGACY_RECORD_VERSION = 1
FLAG_ENVELOPE = 0x01
FLAG_COMMIT = 0x02
FLAG_VOID = 0x04
FLAG_DELETED = 0x08
MAC_BYTES = 8
_HEAD = struct.Struct("<4sBBHQ16sQ8s8s")
_POSITION = struct.Struct("<IQ")
_LEGACY_CHECKSUM = struct.Struct("<Q")
RECORD_HEADER_BYTES = _HEAD.size + MAC_BYTES
assert RECORD_HEADER_BYTES == 64

_KEY_CONTEXT = "statetier 2026-12 disk record key v1"
_NO_OBJECT = bytes(16)
_NO_MAC = bytes(MAC_BYTES)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    object_id: bytes
    generation: int
    body_len: int
    flags: int = 0
    body_mac: bytes = _NO_MAC  # COMMIT records only
    key_id: bytes = bytes(KEY_ID_BYTES)  # as read; a header is always written under the active key

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
    def is_void(self) -> bool:
        return bool(self.flags & FLAG_VOID)

    @property
    def is_deleted(self) -> bool:
        return bool(self.flags & FLAG_DELETED)

    @property
    def is_object(self) -> bool:
        """A live object record: not a COMMIT or VOID record, nor a deleted object's."""
        return not self.flags & (FLAG_COMMIT | FLAG_VOID | FLAG_DELETED)

    def moved(self) -> "RecordHeader":
        """The header of this object record's next compaction copy."""
        return RecordHeader(self.object_id, self.generation + 1, self.body_len, self.flags)

    def deleted(self) -> "RecordHeader":
        """The header a delete writes over this object record."""
        return replace(self, flags=self.flags | FLAG_DELETED)


def is_legacy_header(raw: bytes | bytearray | memoryview) -> bool:
    """Whether ``raw`` starts with an intact record header of format 1."""
    view = memoryview(raw)
    if view.nbytes < RECORD_HEADER_BYTES or bytes(view[:4]) != RECORD_MAGIC or view[4] != LEGACY_RECORD_VERSION:
        return False
    checksum: int = _LEGACY_CHECKSUM.unpack_from(view, 56)[0]
    return checksum == xxhash.xxh3_64_intdigest(view[:56])


class RecordCodec:
    """Record headers packed and read back under the keyring's record keys."""

    def __init__(self, keyring: Keyring) -> None:
        self._keyring = keyring
        self._derived: dict[bytes, bytes] = {}

    # -------------------------------------------------------------- writing

    def pack(self, header: RecordHeader, segment: int, offset: int) -> bytes:
        key_id, key = self._signer()
        head = _HEAD.pack(RECORD_MAGIC, RECORD_VERSION, header.flags, 0, header.body_len, header.object_id,
                          header.generation, key_id, header.body_mac)
        return head + _mac(key, b"H", head, _POSITION.pack(segment, offset))

    def commit_header(self, seq: int, body: bytes | memoryview, segment: int, offset: int) -> bytes:
        """The header of a COMMIT record holding ``body`` at ``offset`` of ``segment``."""
        _, key = self._signer()
        header = RecordHeader(_NO_OBJECT, seq, len(body), FLAG_COMMIT, _mac(key, b"B", body))
        return self.pack(header, segment, offset)

    def void_header(self, record_len: int, segment: int, offset: int) -> bytes:
        """The header that marks ``record_len`` reserved bytes as never used."""
        return self.pack(RecordHeader(_NO_OBJECT, 0, record_len - RECORD_HEADER_BYTES, FLAG_VOID), segment, offset)

    # -------------------------------------------------------------- reading

    def try_unpack(self, raw: bytes | bytearray | memoryview, segment: int, offset: int) -> RecordHeader | None:
        """The header in ``raw`` if it is an authentic one for this place, else None (zeros,
        a torn or foreign header, a format-1 one, one written elsewhere or without the key)."""
        view = memoryview(raw)
        if view.nbytes < RECORD_HEADER_BYTES:
            return None
        magic, version, flags, _res, body_len, oid, gen, key_id, body_mac = _HEAD.unpack_from(view, 0)
        if magic != RECORD_MAGIC or version != RECORD_VERSION:
            return None
        key = self._verifier(key_id)
        if key is None:
            return None
        wanted = _mac(key, b"H", view[: _HEAD.size], _POSITION.pack(segment, offset))
        if not hmac.compare_digest(wanted, bytes(view[_HEAD.size : RECORD_HEADER_BYTES])):
            return None
        return RecordHeader(oid, gen, body_len, flags, body_mac, key_id)

    def unpack_checked(self, raw: bytes | bytearray | memoryview, segment: int, offset: int, object_id: bytes,
                       generation: int) -> RecordHeader:
        """Parse ``raw`` and insist it is the record of ``object_id`` at ``generation`` (live or
        deleted: a reader holding a lease may still read a deleted object's bytes)."""
        if memoryview(raw).nbytes < RECORD_HEADER_BYTES:
            raise TruncatedState("segment ends inside a record header")
        header = self.try_unpack(raw, segment, offset)
        if header is None:
            raise CorruptPayload("no intact record header at the indexed offset")
        if (header.is_commit or header.is_void or header.object_id != object_id
                or header.generation != generation):
            raise CorruptPayload(f"record at the indexed offset is {header.object_id.hex()} generation "
                                 f"{header.generation}, expected {object_id.hex()} generation {generation}")
        return header

    def unknown_key_of(self, raw: bytes | bytearray | memoryview) -> bytes | None:
        """The key id of a record header of today's format that this keyring cannot check (its
        key unknown, or past its grace): another keyring's record, not damage. None otherwise."""
        view = memoryview(raw)
        if view.nbytes < RECORD_HEADER_BYTES or bytes(view[:4]) != RECORD_MAGIC or view[4] != RECORD_VERSION:
            return None
        key_id = bytes(view[40:48])
        return key_id if self._verifier(key_id) is None else None

    def is_commit_body_intact(self, header: RecordHeader, body: bytes | bytearray | memoryview) -> bool:
        key = self._verifier(header.key_id)
        return key is not None and hmac.compare_digest(_mac(key, b"B", body), header.body_mac)

    # -------------------------------------------------------------- keys

    def _signer(self) -> tuple[bytes, bytes]:
        active = self._keyring.active
        if active.secret is None:
            raise ConfigError("the disk tier authenticates its records with the keyring's active key, which "
                              f"holds no secret (key {active.key_id.hex()}): give the daemon a keyring that can sign")
        return active.key_id, self._derive(active.key_id, active.secret)

    def _verifier(self, key_id: bytes) -> bytes | None:
        key = self._keyring.get_for_verify(key_id)
        if key is None or key.secret is None:
            return None
        return self._derive(key.key_id, key.secret)

    def _derive(self, key_id: bytes, secret: bytes) -> bytes:
        derived = self._derived.get(key_id)
        if derived is None:
            derived = self._derived[key_id] = blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest()
        return derived


def _mac(key: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
    hasher = blake3.blake3(key=key)
    for part in parts:
        hasher.update(part)
    return hasher.digest(MAC_BYTES)
