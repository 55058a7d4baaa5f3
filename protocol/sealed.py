"""The sealed object: a signed binary header that binds a payload to its identity.

Sealing and opening live here; this is the module users import the format from.

- ``seal(...)``              — digests the payload in place and returns the signed header;
                               the stored object is ``header + payload``. No payload copy.
- ``seal_object(...)``       — convenience: header and payload joined into one ``bytes``.
- ``open_sealed(blob, expect, keyring)`` — verifies in the order of DESIGN §4 and returns
                               an ``Opened`` (header + a zero-copy payload view), or raises
                               the first failing check's ``RejectedState`` subclass (a key
                               id the keyring cannot verify with: ``UnknownKey``, made by
                               ``unknown_key(key_id)``).
- ``VerifiedHeaders``        — a bounded cache of headers already verified and parsed, each
                               valid while the key it verified under is unchanged (the
                               daemon, the Redis tier); ``ParsedHeaders`` — the SDK's: headers
                               the daemon verified, parsed once.
- ``check_payload`` / ``check_payload_digest`` / ``verify_payload_only`` — payload checks
                               of a header already verified; ``parse_header`` — a header
                               sent without its payload.
- Re-exported from ``sealed_format`` (byte layout, header codec: ``layout_payload``,
  ``decode_header``, ``SealedHeader``…), ``digests`` (``DigestAlg``, ``region_hasher``)
  and ``expectation`` (``Expectation``, identity checks).

Every payload byte belongs to exactly one tensor region (the tensor plus its alignment
padding), each region has its own digest, and the payload digest is the digest of the
region digests, so a single pass over the bytes seals or verifies everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .digests import Bytes, DigestAlg, digest_region, hash_chunk, payload_digest_of, region_hasher
from .dtypes import TensorSpec
from .errors import (BadSignature, CorruptPayload, DestinationMismatch, InvalidRequest, TruncatedState, UnknownKey,
                     UnsupportedFormat)
from .expectation import Expectation, check_identity
from .identity import MAX_U64, STATE_ID_BYTES, Provenance, StateKey
from .keyring import Keyring, SigningKey
from .lru import BoundedLru
from .sealed_format import (
    ALIGN,
    DIGEST_BYTES,
    FLAG_SEALED,
    FLAG_SPECULATIVE,
    FORMAT_VERSION,
    MAGIC,
    PREFIX_BYTES,
    RETIRED_FORMATS,
    SUPPORTED_FORMATS,
    PayloadLayout,
    SealedHeader,
    TensorDescriptor,
    decode_header,
    encode_header,
    frame_object,
    header_length,
    layout_payload,
    parse_fields,
    read_prefix,
)


@dataclass(frozen=True, slots=True)
class Opened:
    """A verified object: its header and a view of its payload (no copy)."""

    header: SealedHeader
    payload: memoryview

    def tensor_views(self) -> list[tuple[TensorSpec, memoryview]]:
        return [(t.spec, self.payload[t.offset : t.offset + t.nbytes]) for t in self.header.tensors]


def seal(
    key: StateKey,
    provenance: Provenance,
    layout: PayloadLayout,
    payload: Bytes,
    *,
    keyring: Keyring,
    state_id: bytes,
    version: int,
    digest_alg: DigestAlg = DigestAlg.BLAKE3,
    contains_speculative: bool = False,
    fingerprint: bytes | None = None,
    region_digests: Sequence[bytes] | None = None,
) -> bytes:
    """Digest ``payload`` (laid out by ``layout``) and return the signed header bytes.
    ``fingerprint``: the identity's fingerprint when the caller computed it already.
    ``region_digests``: the regions' digests when the writer computed them as it copied
    the payload (a windowed put, docs/protocol.md §6.1): signed as given, ``payload`` not
    read; bytes they do not describe make an object every load refuses."""
    if not isinstance(state_id, (bytes, bytearray)) or len(state_id) != STATE_ID_BYTES:
        raise InvalidRequest(f"state_id must be {STATE_ID_BYTES} bytes")  # struct would pad it silently
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_U64:
        raise InvalidRequest(f"version must be an integer in [0, {MAX_U64}]")
    view = memoryview(payload).cast("B")
    if view.nbytes != layout.payload_len:
        raise InvalidRequest(f"payload is {view.nbytes} bytes; layout needs {layout.payload_len}")
    signer = keyring.active
    if region_digests is None:
        region_digests = [
            digest_region(digest_alg, view[off : off + region]) for off, region in zip(layout.offsets, layout.regions)
        ]
    elif len(region_digests) != len(layout.regions) or any(len(d) != DIGEST_BYTES for d in region_digests):
        raise InvalidRequest(f"a put names {len(region_digests)} digests; its {len(layout.regions)} regions "
                             f"need one of {DIGEST_BYTES} bytes each")
    payload_digest = payload_digest_of(digest_alg, region_digests, layout.payload_len)
    flags = FLAG_SEALED | (FLAG_SPECULATIVE if contains_speculative else 0)
    return encode_header(key, provenance, layout, region_digests, payload_digest, signer,
                          state_id, version, digest_alg, flags, fingerprint)


def seal_object(key: StateKey, provenance: Provenance, tensors: Sequence[tuple[TensorSpec, Bytes]],
                **options: Any) -> bytes:
    """Seal tensors given as (spec, buffer) pairs into one ``header + payload`` blob."""
    layout = layout_payload([spec for spec, _ in tensors])
    payload = bytearray(layout.payload_len)
    view = memoryview(payload)
    for (spec, data), off in zip(tensors, layout.offsets):
        src = memoryview(data).cast("B")
        if src.nbytes != spec.nbytes:
            raise InvalidRequest(f"tensor {spec.name!r} has {src.nbytes} bytes; its spec needs {spec.nbytes}")
        view[off : off + spec.nbytes] = src
    header = seal(key, provenance, layout, payload, **options)
    return header + payload


def unknown_key(key_id: bytes) -> UnknownKey:
    """The refusal of an object signed under a key id this keyring cannot verify with."""
    return UnknownKey(f"unknown or retired key id {key_id.hex()}: this daemon's keyring does not hold it; "
                      f"daemons that share a tier (Redis) must share one keys.keyring_file (statetier keygen), "
                      f"and a rotation must keep the old key until its grace ends. The object is left in place")


def _check_signature(view: memoryview, prefix: tuple[Any, ...], keyring: Keyring) -> None:
    _magic, _fmt, sig_code, _dig, header_len, _res, _plen, key_id = prefix
    key = keyring.get_for_verify(key_id)
    if key is None:
        raise unknown_key(key_id)
    if sig_code != int(key.alg):
        raise BadSignature(f"signature algorithm {sig_code} does not match key {key_id.hex()}")
    sig_len = key.alg.signature_bytes
    if header_len < PREFIX_BYTES + sig_len:
        raise BadSignature("header too short to hold a signature")
    if not key.verify(view[: header_len - sig_len], view[header_len - sig_len : header_len]):
        raise BadSignature(f"header signature does not verify under key {key_id.hex()}")


@dataclass(frozen=True, slots=True)
class _Verified:
    header: SealedHeader
    key: SigningKey  # the key object the signature verified under


class VerifiedHeaders:
    """Headers whose signature verified and which parsed, by their exact bytes (a ``BoundedLru``).

    A hot object is loaded again and again: its header is verified and parsed once. A hit
    counts only while the keyring hands out the very key object the signature verified
    under: identical bytes under an unchanged key verify identically, so a hit skips only
    work whose result is known. A key retired, expired or replaced since is a miss, and the
    full check decides again (``BadSignature`` for a key no longer known). Identity, version
    and payload checks run on every load. Used by the daemon's serving path and the Redis
    tier's reads (on the loop and in executor threads alike).
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._headers: BoundedLru[bytes, _Verified] = BoundedLru(capacity)

    def __len__(self) -> int:
        return len(self._headers)

    def get(self, header_bytes: bytes, keyring: Keyring) -> SealedHeader | None:
        """The parsed header, if these exact bytes verified before under a key ``keyring``
        still hands out unchanged."""
        known = self._headers.get(header_bytes)
        if known is None or keyring.get_for_verify(known.header.key_id) is not known.key:
            return None
        return known.header

    def put(self, header_bytes: bytes, header: SealedHeader, keyring: Keyring) -> None:
        key = keyring.get_for_verify(header.key_id)
        if key is not None:
            self._headers.put(header_bytes, _Verified(header, key))


def open_sealed(blob: Bytes, expect: Expectation | None, keyring: Keyring, *, verify_payload: bool = True,
                verified: VerifiedHeaders | None = None) -> Opened:
    """Verify ``blob`` against ``expect`` in DESIGN §4 order; return header + payload view.

    ``expect=None`` checks only what needs no expectation (framing, signature, format,
    payload); ``verify_payload=False`` skips the digest pass for bytes that never left a
    trusted, verified tier (the header is still verified). ``verified``: a cache of
    headers already verified and parsed (steps 2–3′ are then a dict lookup).
    """
    view, prefix = frame_object(blob)  # 1
    header = None
    if verified is not None:
        header_bytes = bytes(view[: prefix[4]])
        header = verified.get(header_bytes, keyring)  # 2-3, verified before under the same key
    if header is None:
        _check_signature(view, prefix, keyring)  # 2
        if prefix[1] not in SUPPORTED_FORMATS:  # 3
            why = RETIRED_FORMATS.get(prefix[1], "")
            raise UnsupportedFormat(f"format version {prefix[1]} (this build reads {sorted(SUPPORTED_FORMATS)})"
                                    + (f": {why}" if why else ""))
        header = parse_fields(view, prefix)
        if verified is not None:
            verified.put(header_bytes, header, keyring)
    if expect is not None:
        check_identity(header, expect)  # 4-8
    payload = view[header.header_len :]
    _check_tensors(header, expect)  # 9, shapes
    if verify_payload:
        check_payload(header, payload)  # 9, digest
    return Opened(header, payload)


def _check_tensors(header: SealedHeader, expect: Expectation | None) -> None:
    cursor = 0
    for i, t in enumerate(header.tensors):
        last = i + 1 == len(header.tensors)
        padding = t.region - t.nbytes
        if t.offset != cursor or padding < 0 or padding >= ALIGN or (last and padding):
            raise CorruptPayload(f"tensor {t.spec.name!r} does not tile the payload")
        cursor += t.region
    if cursor != header.payload_len:
        raise CorruptPayload(f"tensors cover {cursor} bytes of a {header.payload_len}-byte payload")
    if expect is not None and expect.tensors is not None:
        got = tuple(t.spec for t in header.tensors)
        if got != tuple(expect.tensors):
            raise DestinationMismatch(f"tensors {[(s.name, s.dtype, s.shape) for s in got]} differ from the "
                                      f"expected {[(s.name, s.dtype, s.shape) for s in expect.tensors]}")


def check_payload(header: SealedHeader, payload: Bytes) -> None:
    """Recompute every region digest and the payload digest of ``payload`` (needs no key:
    the digests are unkeyed; the header that binds them must have been verified)."""
    payload = memoryview(payload).cast("B")
    digests: list[bytes] = []
    for t in header.tensors:
        digest = digest_region(header.digest_alg, payload[t.offset : t.offset + t.region])
        if digest != t.digest:
            raise CorruptPayload(f"tensor {t.spec.name!r} digest mismatch")
        digests.append(digest)
    check_payload_digest(header, digests)


def check_payload_digest(header: SealedHeader, region_digests: Sequence[bytes]) -> None:
    """The payload digest over region digests that each already matched their descriptor."""
    if payload_digest_of(header.digest_alg, region_digests, header.payload_len) != header.payload_digest:
        raise CorruptPayload("payload digest mismatch")


def verify_payload_only(header: SealedHeader, payload: Bytes, keyring: Keyring | None = None) -> None:
    """Re-check the payload of an already opened header (bytes copied to where they land).

    ``keyring`` is accepted for callers of format 1, whose digests were keyed; format 2
    digests need none.
    """
    _check_tensors(header, None)
    check_payload(header, payload)


def parse_header(header_bytes: Bytes) -> SealedHeader:
    """Parse a header given without its payload (what a daemon sends a client beside the
    payload it placed elsewhere). Verifies nothing: the daemon checked the signature."""
    view = memoryview(header_bytes).cast("B")
    prefix = read_prefix(view)
    if prefix[4] != view.nbytes:
        raise TruncatedState(f"header length {prefix[4]} but {view.nbytes} header bytes given")
    if prefix[1] not in SUPPORTED_FORMATS:
        raise UnsupportedFormat(f"format version {prefix[1]} (this build reads {sorted(SUPPORTED_FORMATS)})")
    header = parse_fields(view, prefix)
    _check_tensors(header, None)
    return header


class ParsedHeaders:
    """Headers sent without their payload, parsed once by their exact bytes (a ``BoundedLru``):
    the SDK's counterpart of ``VerifiedHeaders``. It verifies nothing, as ``parse_header``:
    the daemon checked the signature, and the payload is verified where it lands."""

    def __init__(self, capacity: int = 1024) -> None:
        self._headers: BoundedLru[bytes, SealedHeader] = BoundedLru(capacity)

    def __len__(self) -> int:
        return len(self._headers)

    def parse(self, header_bytes: Bytes) -> SealedHeader:
        key = bytes(header_bytes)
        header = self._headers.get(key)
        if header is None:
            header = parse_header(key)
            self._headers.put(key, header)
        return header


__all__ = [
    "ALIGN", "DigestAlg", "Expectation", "FORMAT_VERSION", "MAGIC", "Opened", "PREFIX_BYTES", "ParsedHeaders",
    "PayloadLayout", "SealedHeader", "TensorDescriptor", "VerifiedHeaders", "check_payload", "check_payload_digest",
    "decode_header", "hash_chunk", "header_length", "layout_payload", "open_sealed", "parse_header",
    "payload_digest_of", "region_hasher", "seal",
    "seal_object", "verify_payload_only",
]
