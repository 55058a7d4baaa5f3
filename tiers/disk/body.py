"""The body of a disk record: written plain or as an at-rest envelope, read back verified.

``RecordBody(keyring, cipher)`` — blocking methods the tier runs in its executor:

- ``body_len(size)`` — bytes the body of a ``size``-byte sealed object takes on disk.
- ``records`` — the ``RecordCodec`` (``tiers.disk.records``) authenticating record headers
  under the keyring: the segment files of the tier are opened with it.
- ``header_for(object_id, size)`` — the record header such an object gets (it depends on
  nothing else, so the tier knows it when it reserves the record).
- ``write_record(file, offset, object_id, size, views)`` — the record header and the body,
  in one pwritev; with a cipher the object is sealed into an AES-GCM envelope first.
- ``append(file, offset, written, views)`` — more body bytes of a plain record.
- ``read_verified(file, location, object_id)`` — pread the record, check its header, open
  the envelope if it is one, then ``protocol.classify.open_intact``: signature and
  payload digest. Returns the plain sealed blob in a fresh buffer, or raises the damage
  (``CorruptPayload``, ``BadSignature``, ``TruncatedState`` …). Integrity only: whether
  the object is the one stored under this id is the engine's judgement
  (``protocol.classify``), so an intact object of another identity is returned as found.
- ``read_verified_into(file, location, object_id, dest)`` — the same into a caller's buffer:
  a plain record is read straight into it with one preadv and verified there.
- ``read_signed`` / ``read_signed_into`` — the same without the pass over the payload
  (framing and signature only): for a load whose client verifies the payload where it
  lands (docs/protocol.md §6.1).
"""

from __future__ import annotations

from statetier.protocol.errors import ConfigError, InvalidRequest
from statetier.protocol.keyring import Keyring
from statetier.protocol.classify import open_intact
from statetier.protocol.passes import copy_into
from ..crypto import ENVELOPE_BYTES, TAG_BYTES, AtRestCipher
from .index import Location
from .records import FLAG_ENVELOPE, RECORD_HEADER_BYTES, RecordCodec, RecordHeader
from .segments import SegmentFile


class RecordBody:
    def __init__(self, keyring: Keyring, cipher: AtRestCipher | None) -> None:
        self.keyring = keyring
        self.cipher = cipher
        self.records = RecordCodec(keyring)

    def body_len(self, size: int) -> int:
        return size + (ENVELOPE_BYTES + TAG_BYTES if self.cipher else 0)

    def header_for(self, object_id: bytes, size: int) -> RecordHeader:
        flags = FLAG_ENVELOPE if self.cipher is not None else 0
        return RecordHeader(object_id, 1, self.body_len(size), flags)

    def write_record(self, file: SegmentFile, offset: int, object_id: bytes, size: int,
                     views: list[memoryview]) -> None:
        header = file.header_bytes(self.header_for(object_id, size), offset)
        if self.cipher is None:
            file.write_at(offset, [header, *views])
            return
        envelope = self.cipher.seal_envelope(views[0] if len(views) == 1 else b"".join(views))
        if len(envelope) != self.body_len(size):
            raise InvalidRequest("the written object's size differs from its metadata")
        file.write_at(offset, [header, envelope])

    def append(self, file: SegmentFile, offset: int, written: int, views: list[memoryview]) -> None:
        file.write_at(offset + RECORD_HEADER_BYTES + written, views)

    def read_verified(self, file: SegmentFile, location: Location, object_id: bytes) -> bytes | bytearray:
        return self._read(file, location, object_id, verify_payload=True)

    def read_signed(self, file: SegmentFile, location: Location, object_id: bytes) -> bytes | bytearray:
        return self._read(file, location, object_id, verify_payload=False)

    def read_verified_into(self, file: SegmentFile, location: Location, object_id: bytes, dest: memoryview) -> None:
        """``read_verified`` into ``dest`` (the sealed object's exact size): a plain record is
        read straight into it and verified there; an envelope is opened, then copied."""
        self._read_into(file, location, object_id, dest, verify_payload=True)

    def read_signed_into(self, file: SegmentFile, location: Location, object_id: bytes, dest: memoryview) -> None:
        self._read_into(file, location, object_id, dest, verify_payload=False)

    def _read(self, file: SegmentFile, location: Location, object_id: bytes, *,
              verify_payload: bool) -> bytes | bytearray:
        header, body = file.read_record(location.offset, location.record_len, object_id, location.generation)
        blob: bytes | bytearray = body
        if header.is_envelope:
            if self.cipher is None:
                raise ConfigError(f"object {object_id.hex()} is encrypted at rest; no at-rest cipher is configured")
            blob = self.cipher.open_envelope(body)
        open_intact(blob, self.keyring, verify_payload=verify_payload)
        return blob

    def _read_into(self, file: SegmentFile, location: Location, object_id: bytes, dest: memoryview, *,
                   verify_payload: bool) -> None:
        if self.cipher is not None or location.record_len - RECORD_HEADER_BYTES != dest.nbytes:
            # it raises what is wrong with the record
            blob = self._read(file, location, object_id, verify_payload=verify_payload)
            if len(blob) != dest.nbytes:
                raise InvalidRequest(f"a {dest.nbytes}-byte destination for a {len(blob)}-byte object")
            copy_into(dest, blob)
            return
        header = file.read_record_into(location.offset, location.record_len, object_id, location.generation, dest)
        if header.is_envelope:
            raise ConfigError(f"object {object_id.hex()} is encrypted at rest; no at-rest cipher is configured")
        open_intact(dest, self.keyring, verify_payload=verify_payload)

    def read_many(self, jobs: list[tuple[SegmentFile, Location, bytes]]) -> list[bytes | bytearray | Exception]:
        """``read_verified`` for each job; a failure is returned in its place, not raised."""
        out: list[bytes | bytearray | Exception] = []
        for file, location, object_id in jobs:
            try:
                out.append(self.read_verified(file, location, object_id))
            except Exception as exc:
                out.append(exc)
        return out
