"""The sealed object: a signed binary header that binds a payload to its identity.

- ``layout_payload(specs)``  — byte offsets of each tensor (64-byte aligned) and the total.
- ``seal(...)``              — digests the payload in place and returns the signed header;
                               the stored object is ``header + payload``. No payload copy.
- ``seal_object(...)``       — convenience: header and payload joined into one ``bytes``.
- ``open_sealed(blob, expect, keyring)`` — verifies in the order of DESIGN §4 and returns
                               an ``Opened`` (header + a zero-copy payload view), or raises
                               the first failing check's ``RejectedState`` subclass.
- ``decode_header(blob)``    — parses a header without verifying it (``statetier inspect``).
- ``Expectation``            — what a load expects: by StateRef (a handoff) or by StateKey
                               (prefix reuse), plus what the version registry knows.

The byte layout is in docs/protocol.md and in ``_PREFIX`` / ``_BODY`` / ``_TENSOR`` below.
Every payload byte belongs to exactly one tensor region (the tensor plus its alignment
padding), each region has its own digest, and the payload digest is the digest of the
region digests, so a single pass over the bytes seals or verifies everything.
"""

from __future__ import annotations

import enum
import struct

import blake3
from dataclasses import dataclass, field
from typing import Sequence

from . import dtypes
from .dtypes import TensorSpec
from .errors import (
    BadSignature,
    CorruptPayload,
    FingerprintMismatch,
    InvalidRequest,
    MalformedState,
    MisroutedState,
    NamespaceMismatch,
    PlacementMismatch,
    PositionMismatch,
    StaleState,
    TruncatedState,
    UnsupportedFormat,
)
from .identity import (
    MAX_U64,
    STATE_ID_BYTES,
    Kind,
    Namespace,
    Provenance,
    StateKey,
    StateRef,
    fingerprint,
    stream_id,
)
from .keyring import Keyring, SigAlg, SigningKey

MAGIC = b"STSO"
FORMAT_VERSION = 2
SUPPORTED_FORMATS = frozenset({2})
#: Format 1 bound *keyed* BLAKE3 digests (a verifier needed the signing key); it is refused
#: with ``UnsupportedFormat`` after its signature verified, never read with format 2 rules.
RETIRED_FORMATS = {1: "format 1 bound keyed payload digests; re-put the object to reseal it unkeyed"}
ALIGN = 64
DIGEST_BYTES = 32

FLAG_SPECULATIVE = 0x01
FLAG_SEALED = 0x02
_KNOWN_FLAGS = FLAG_SPECULATIVE | FLAG_SEALED


class DigestAlg(enum.IntEnum):
    BLAKE3 = 1  # plain (unkeyed) BLAKE3-256: anyone can recompute it, nobody needs a key
    XXH3_128 = 2  # corruption check only, for trusted media

    @property
    def label(self) -> str:
        return "blake3" if self is DigestAlg.BLAKE3 else "xxh3-128"


# magic, format, sig_alg, digest_alg, header_len, reserved, payload_len, key_id
_PREFIX = struct.Struct("<4sHBBII Q8s")
# kind, flags, shard, layer, namespace, prefix_hash, token_start, token_end, step,
# created_at_ns, state_id, version, fingerprint, payload_digest, n_group_layers, n_tensors,
# request_id_len, producer_len, reserved
_BODY = struct.Struct("<BBHI32s32sQQQQ16sQ32s32sHHBBH")
# name_len (name follows), then dtype, ndim (shape follows), offset, nbytes, digest
_TENSOR_HEAD = struct.Struct("<B")
_TENSOR_TAIL = struct.Struct("<QQ32s")
PREFIX_BYTES = _PREFIX.size
FIXED_BYTES = _PREFIX.size + _BODY.size
assert PREFIX_BYTES == 32 and FIXED_BYTES == 232


@dataclass(frozen=True, slots=True)
class TensorDescriptor:
    spec: TensorSpec
    offset: int
    nbytes: int
    region: int  # bytes covered by ``digest``: the tensor plus its alignment padding
    digest: bytes


@dataclass(frozen=True, slots=True)
class PayloadLayout:
    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]
    regions: tuple[int, ...]
    payload_len: int


def layout_payload(specs: Sequence[TensorSpec]) -> PayloadLayout:
    """Place tensors back to back, each starting on a 64-byte boundary."""
    offsets, regions, cursor = [], [], 0
    for i, spec in enumerate(specs):
        offsets.append(cursor)
        cursor += spec.nbytes
        if i + 1 < len(specs):
            cursor = -(-cursor // ALIGN) * ALIGN
        regions.append(cursor - offsets[-1])
    return PayloadLayout(tuple(specs), tuple(offsets), tuple(regions), cursor)


@dataclass(frozen=True, slots=True)
class SealedHeader:
    format_version: int
    sig_alg: SigAlg
    digest_alg: DigestAlg
    header_len: int
    payload_len: int
    key_id: bytes
    key: StateKey
    provenance: Provenance
    flags: int
    state_id: bytes
    version: int
    fingerprint: bytes
    payload_digest: bytes
    tensors: tuple[TensorDescriptor, ...]

    @property
    def contains_speculative(self) -> bool:
        return bool(self.flags & FLAG_SPECULATIVE)

    @property
    def is_sealed(self) -> bool:
        return bool(self.flags & FLAG_SEALED)

    @property
    def stream_id(self) -> bytes:
        return stream_id(self.key, self.provenance.request_id)

    def ref(self) -> StateRef:
        return StateRef(self.key, self.provenance.request_id, self.provenance.step,
                        self.state_id, self.version, self.fingerprint)

    def describe(self) -> dict:
        """A JSON-ready view for ``statetier inspect`` and logs."""
        return {
            "format_version": self.format_version,
            "kind": self.key.kind.name.lower(),
            "namespace": self.key.namespace.hex(),
            "layer": self.key.layer,
            "group_layers": list(self.key.group_layers),
            "shard": self.key.shard,
            "prefix_hash": self.key.prefix_hash.hex(),
            "token_start": self.key.token_start,
            "token_end": self.key.token_end,
            "request_id": self.provenance.request_id,
            "step": self.provenance.step,
            "producer_id": self.provenance.producer_id,
            "created_at_ns": self.provenance.created_at_ns,
            "state_id": self.state_id.hex(),
            "version": self.version,
            "fingerprint": self.fingerprint.hex(),
            "flags": {"contains_speculative": self.contains_speculative, "sealed": self.is_sealed},
            "digest_alg": self.digest_alg.label,
            "payload_digest": self.payload_digest.hex(),
            "sig_alg": self.sig_alg.label,
            "key_id": self.key_id.hex(),
            "header_len": self.header_len,
            "payload_len": self.payload_len,
            "tensors": [
                {"name": t.spec.name, "dtype": t.spec.dtype, "shape": list(t.spec.shape),
                 "offset": t.offset, "nbytes": t.nbytes, "digest": t.digest.hex()}
                for t in self.tensors
            ],
        }


@dataclass(frozen=True, slots=True)
class Opened:
    """A verified object: its header and a view of its payload (no copy)."""

    header: SealedHeader
    payload: memoryview

    def tensor_views(self) -> list[tuple[TensorSpec, memoryview]]:
        return [(t.spec, self.payload[t.offset : t.offset + t.nbytes]) for t in self.header.tensors]


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a load states it expects. Build it with ``for_ref`` or ``for_key``.

    ``key`` carries the *requester's* namespace. ``newest_version`` and ``state_id_stream``
    come from the version registry: the newest version known for the stream, and the stream
    that the expected ``state_id`` was issued for.
    """

    key: StateKey
    request_id: str | None = None
    step: int | None = None
    state_id: bytes | None = None
    version: int | None = None
    fingerprint: bytes | None = None
    newest_version: int | None = None
    state_id_stream: bytes | None = None
    tensors: tuple[TensorSpec, ...] | None = None
    allow_speculative: bool = False

    @classmethod
    def for_ref(cls, ref: StateRef, namespace: Namespace, **extra) -> "Expectation":
        key = StateKey(namespace, ref.key.kind, ref.key.layer, ref.key.prefix_hash,
                       ref.key.token_start, ref.key.token_end, ref.key.shard, ref.key.group_layers)
        return cls(key, ref.request_id, ref.step, ref.state_id, ref.version, ref.fingerprint, **extra)

    @classmethod
    def for_key(cls, key: StateKey, **extra) -> "Expectation":
        return cls(key, **extra)

    @property
    def is_handoff(self) -> bool:
        return self.state_id is not None


# ---------------------------------------------------------------------------- sealing


def _digest_region(alg: DigestAlg, data) -> bytes:
    if alg is DigestAlg.BLAKE3:
        return blake3.blake3(data).digest()
    import xxhash

    return xxhash.xxh3_128_digest(data) + bytes(16)


def region_hasher(alg: DigestAlg):
    """An incremental hasher of one region (``update(bytes)``, ``digest()``) for ``alg``."""
    if alg is DigestAlg.BLAKE3:
        return blake3.blake3()
    import xxhash

    return _Xxh3Region(xxhash.xxh3_128())


class _Xxh3Region:
    __slots__ = ("_h",)

    def __init__(self, h) -> None:
        self._h = h

    def update(self, data) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest() + bytes(16)


def payload_digest_of(alg: DigestAlg, region_digests: Sequence[bytes], payload_len: int) -> bytes:
    """The payload digest over the region digests (docs/protocol.md §2.2)."""
    joined = struct.pack("<Q", payload_len) + b"".join(region_digests)
    return _digest_region(alg, memoryview(joined))


def seal(
    key: StateKey,
    provenance: Provenance,
    layout: PayloadLayout,
    payload,
    *,
    keyring: Keyring,
    state_id: bytes,
    version: int,
    digest_alg: DigestAlg = DigestAlg.BLAKE3,
    contains_speculative: bool = False,
) -> bytes:
    """Digest ``payload`` (laid out by ``layout``) and return the signed header bytes."""
    if not isinstance(state_id, (bytes, bytearray)) or len(state_id) != STATE_ID_BYTES:
        raise InvalidRequest(f"state_id must be {STATE_ID_BYTES} bytes")  # struct would pad it silently
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_U64:
        raise InvalidRequest(f"version must be an integer in [0, {MAX_U64}]")
    view = memoryview(payload).cast("B")
    if view.nbytes != layout.payload_len:
        raise InvalidRequest(f"payload is {view.nbytes} bytes; layout needs {layout.payload_len}")
    signer = keyring.active
    region_digests = [
        _digest_region(digest_alg, view[off : off + region]) for off, region in zip(layout.offsets, layout.regions)
    ]
    payload_digest = payload_digest_of(digest_alg, region_digests, layout.payload_len)
    flags = FLAG_SEALED | (FLAG_SPECULATIVE if contains_speculative else 0)
    return _encode_header(key, provenance, layout, region_digests, payload_digest, signer,
                          state_id, version, digest_alg, flags)


def seal_object(key: StateKey, provenance: Provenance, tensors: Sequence[tuple[TensorSpec, object]],
                **options) -> bytes:
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


def _encode_header(key, provenance, layout, region_digests, payload_digest, signer: SigningKey,
                   state_id, version, digest_alg, flags) -> bytes:
    request_id = provenance.request_id.encode()
    producer = provenance.producer_id.encode()
    parts = [
        b"",  # prefix, filled below once the length is known
        _BODY.pack(
            int(key.kind), flags, key.shard, key.layer, key.namespace.digest, key.prefix_hash,
            key.token_start, key.token_end, provenance.step, provenance.created_at_ns, state_id,
            version, fingerprint(key, provenance.request_id, provenance.step), payload_digest,
            len(key.group_layers), len(layout.specs), len(request_id), len(producer), 0,
        ),
        struct.pack(f"<{len(key.group_layers)}I", *key.group_layers),
        request_id,
        producer,
    ]
    for spec, off, region, digest in zip(layout.specs, layout.offsets, layout.regions, region_digests):
        name = spec.name.encode()
        parts.append(_TENSOR_HEAD.pack(len(name)) + name)
        parts.append(struct.pack(f"<BB{len(spec.shape)}Q", dtypes.dtype_code(spec.dtype), len(spec.shape), *spec.shape))
        parts.append(_TENSOR_TAIL.pack(off, region, digest))
    sig_len = signer.alg.signature_bytes
    unsigned = PREFIX_BYTES + sum(len(p) for p in parts)
    header_len = -(-(unsigned + sig_len) // ALIGN) * ALIGN
    parts.append(bytes(header_len - sig_len - unsigned))
    parts[0] = _PREFIX.pack(MAGIC, FORMAT_VERSION, int(signer.alg), int(digest_alg), header_len, 0,
                            layout.payload_len, signer.key_id)
    body = b"".join(parts)
    return body + signer.sign(body)


def header_length(key: StateKey, provenance: Provenance, specs: Sequence[TensorSpec], sig_alg: SigAlg) -> int:
    """The length ``seal`` will produce for this identity, known before any digest (for
    zero-copy puts that reserve header + payload in one arena extent)."""
    unsigned = FIXED_BYTES + 4 * len(key.group_layers) + len(provenance.request_id.encode())
    unsigned += len(provenance.producer_id.encode())
    for spec in specs:
        unsigned += _TENSOR_HEAD.size + len(spec.name.encode()) + 2 + 8 * len(spec.shape) + _TENSOR_TAIL.size
    return -(-(unsigned + sig_alg.signature_bytes) // ALIGN) * ALIGN


# ---------------------------------------------------------------------------- opening


def _frame(blob) -> tuple[memoryview, tuple]:
    view = memoryview(blob).cast("B")
    if view.nbytes < PREFIX_BYTES:
        raise TruncatedState(f"{view.nbytes} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    prefix = _PREFIX.unpack_from(view, 0)
    magic, _fmt, _sig, _dig, header_len, _res, payload_len, _kid = prefix
    if magic != MAGIC:
        raise MalformedState("bad magic: not a statetier sealed object")
    if header_len < PREFIX_BYTES or header_len > view.nbytes:
        raise TruncatedState(f"header length {header_len} does not fit in {view.nbytes} bytes")
    if payload_len != view.nbytes - header_len:
        raise TruncatedState(f"payload length {payload_len} but {view.nbytes - header_len} bytes present")
    return view, prefix


def _check_signature(view: memoryview, prefix: tuple, keyring: Keyring) -> None:
    _magic, _fmt, sig_code, _dig, header_len, _res, _plen, key_id = prefix
    key = keyring.get_for_verify(key_id)
    if key is None:
        raise BadSignature(f"unknown or retired key id {key_id.hex()}")
    if sig_code != int(key.alg):
        raise BadSignature(f"signature algorithm {sig_code} does not match key {key_id.hex()}")
    sig_len = key.alg.signature_bytes
    if header_len < PREFIX_BYTES + sig_len:
        raise BadSignature("header too short to hold a signature")
    if not key.verify(view[: header_len - sig_len], view[header_len - sig_len : header_len]):
        raise BadSignature(f"header signature does not verify under key {key_id.hex()}")


def decode_header(blob) -> SealedHeader:
    """Parse a header without verifying it; raises ``TruncatedState`` / ``MalformedState``."""
    view, prefix = _frame(blob)
    return _parse(view, prefix)


def _parse(view: memoryview, prefix: tuple) -> SealedHeader:
    _magic, fmt, sig_code, dig_code, header_len, _res, payload_len, key_id = prefix
    try:
        sig_alg, digest_alg = SigAlg(sig_code), DigestAlg(dig_code)
        (kind, flags, shard, layer, namespace, prefix_hash, token_start, token_end, step, created,
         state_id, version, fp, payload_digest, n_groups, n_tensors, rid_len, prod_len, _r
         ) = _BODY.unpack_from(view, PREFIX_BYTES)
        pos = FIXED_BYTES
        groups = struct.unpack_from(f"<{n_groups}I", view, pos)
        pos += 4 * n_groups
        request_id = bytes(view[pos : pos + rid_len]).decode()
        pos += rid_len
        producer = bytes(view[pos : pos + prod_len]).decode()
        pos += prod_len
        tensors = []
        for _ in range(n_tensors):
            (name_len,) = _TENSOR_HEAD.unpack_from(view, pos)
            name = bytes(view[pos + 1 : pos + 1 + name_len]).decode()
            pos += 1 + name_len
            code, ndim = struct.unpack_from("<BB", view, pos)
            shape = struct.unpack_from(f"<{ndim}Q", view, pos + 2)
            pos += 2 + 8 * ndim
            offset, region, digest = _TENSOR_TAIL.unpack_from(view, pos)
            pos += _TENSOR_TAIL.size
            spec = TensorSpec(name, dtypes.dtype_name(code), shape)
            tensors.append(TensorDescriptor(spec, offset, spec.nbytes, region, digest))
        if pos + sig_alg.signature_bytes > header_len:
            raise MalformedState("header fields overrun the header length")
        if flags & ~_KNOWN_FLAGS:
            raise MalformedState(f"unknown flags {flags:#x}")
        key = StateKey(Namespace(namespace), Kind(kind), layer, prefix_hash, token_start, token_end,
                       shard, groups)
        provenance = Provenance(request_id, step, producer, created)
    except MalformedState:
        raise
    except (struct.error, ValueError, UnicodeDecodeError, InvalidRequest) as exc:
        raise MalformedState(f"unparsable header: {exc}") from exc
    return SealedHeader(fmt, sig_alg, digest_alg, header_len, payload_len, bytes(key_id), key,
                        provenance, flags, state_id, version, fp, payload_digest, tuple(tensors))


class VerifiedHeaders:
    """Headers whose signature verified and which parsed, by their exact bytes (bounded LRU).

    A hot object is loaded again and again: its header is verified and parsed once. A hit
    still asks the keyring whether the signing key may verify (a retired or expired key is
    ``BadSignature`` as before); identity, version and payload checks run on every load.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._headers: dict[bytes, SealedHeader] = {}

    def __len__(self) -> int:
        return len(self._headers)

    def get(self, header_bytes: bytes) -> SealedHeader | None:
        header = self._headers.pop(header_bytes, None)
        if header is not None:
            self._headers[header_bytes] = header  # most recent last
        return header

    def put(self, header_bytes: bytes, header: SealedHeader) -> None:
        self._headers[header_bytes] = header
        if len(self._headers) > self.capacity:
            del self._headers[next(iter(self._headers))]


def open_sealed(blob, expect: Expectation | None, keyring: Keyring, *, verify_payload: bool = True,
                verified: VerifiedHeaders | None = None) -> Opened:
    """Verify ``blob`` against ``expect`` in DESIGN §4 order; return header + payload view.

    ``expect=None`` checks only what needs no expectation (framing, signature, format,
    payload); ``verify_payload=False`` skips the digest pass for bytes that never left a
    trusted, verified tier (the header is still verified). ``verified``: a cache of
    headers already verified and parsed (steps 2–3′ are then a dict lookup).
    """
    view, prefix = _frame(blob)  # 1
    header = None
    if verified is not None:
        header_bytes = bytes(view[: prefix[4]])
        header = verified.get(header_bytes)
        if header is not None and keyring.get_for_verify(header.key_id) is None:
            raise BadSignature(f"unknown or retired key id {header.key_id.hex()}")  # 2, since cached
    if header is None:
        _check_signature(view, prefix, keyring)  # 2
        if prefix[1] not in SUPPORTED_FORMATS:  # 3
            why = RETIRED_FORMATS.get(prefix[1], "")
            raise UnsupportedFormat(f"format version {prefix[1]} (this build reads {sorted(SUPPORTED_FORMATS)})"
                                    + (f": {why}" if why else ""))
        header = _parse(view, prefix)
        if verified is not None:
            verified.put(header_bytes, header)
    if expect is not None:
        _check_identity(header, expect)  # 4-8
    payload = view[header.header_len :]
    _check_tensors(header, expect)  # 9, shapes
    if verify_payload:
        check_payload(header, payload)  # 9, digest
    return Opened(header, payload)


def _check_identity(header: SealedHeader, expect: Expectation) -> None:
    got, want = header.key, expect.key
    if got.namespace != want.namespace:
        raise NamespaceMismatch(f"namespace {got.namespace.hex()[:16]}… is not the requester's "
                                f"{want.namespace.hex()[:16]}…")
    if got.placement() != want.placement():
        raise PlacementMismatch(f"object is {got.kind.name} layer {got.layer} shard {got.shard}; "
                                f"expected {want.kind.name} layer {want.layer} shard {want.shard}")
    if got.position() != want.position():
        raise PositionMismatch(f"object covers tokens [{got.token_start}, {got.token_end}) of prefix "
                               f"{got.prefix_hash.hex()[:12]}…; expected [{want.token_start}, "
                               f"{want.token_end}) of {want.prefix_hash.hex()[:12]}…")
    if got.kind is Kind.SSM:
        if header.contains_speculative and not expect.allow_speculative:
            raise PositionMismatch("snapshot contains speculative tokens")
        if not header.is_sealed:
            raise PositionMismatch("snapshot was not sealed at a committed token boundary")
    _check_fingerprint(header, expect)
    _check_version(header, expect)


def _check_fingerprint(header: SealedHeader, expect: Expectation) -> None:
    if expect.request_id is not None:
        wanted = fingerprint(expect.key, expect.request_id, expect.step or 0)
        if expect.fingerprint is not None and expect.fingerprint != wanted:
            raise FingerprintMismatch("the reference's fingerprint does not match its own identity")
    else:
        prov = header.provenance
        wanted = fingerprint(expect.key, prov.request_id, prov.step)
    if header.fingerprint != wanted:
        raise FingerprintMismatch("object fingerprint differs from the one recomputed from the expectation")


def _check_version(header: SealedHeader, expect: Expectation) -> None:
    if expect.state_id is not None:
        if expect.state_id_stream is not None and expect.state_id_stream != stream_id(expect.key, expect.request_id or ""):
            raise MisroutedState(f"state_id {expect.state_id.hex()} was issued for another stream")
        if header.state_id != expect.state_id:
            if expect.version is not None and header.version < expect.version:
                raise StaleState(f"found version {header.version}, older than the expected {expect.version}")
            if expect.version is not None and header.version > expect.version:
                raise StaleState(f"the expected version {expect.version} was superseded by {header.version}")
            raise MisroutedState(f"found state_id {header.state_id.hex()}, expected {expect.state_id.hex()}")
        if expect.version is not None and header.version != expect.version:
            raise MisroutedState(f"state_id {header.state_id.hex()} carries version {header.version}, "
                                 f"expected {expect.version}")
    if expect.newest_version is not None and header.version < expect.newest_version:
        raise StaleState(f"version {header.version} is older than the newest known {expect.newest_version}")


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
            raise CorruptPayload(f"tensors {[(s.name, s.dtype, s.shape) for s in got]} differ from the expected "
                                 f"{[(s.name, s.dtype, s.shape) for s in expect.tensors]}")


def check_payload(header: SealedHeader, payload) -> None:
    """Recompute every region digest and the payload digest of ``payload`` (needs no key:
    the digests are unkeyed; the header that binds them must have been verified)."""
    payload = memoryview(payload).cast("B")
    digests = []
    for t in header.tensors:
        digest = _digest_region(header.digest_alg, payload[t.offset : t.offset + t.region])
        if digest != t.digest:
            raise CorruptPayload(f"tensor {t.spec.name!r} digest mismatch")
        digests.append(digest)
    check_payload_digest(header, digests)


def check_payload_digest(header: SealedHeader, region_digests: Sequence[bytes]) -> None:
    """The payload digest over region digests that each already matched their descriptor."""
    if payload_digest_of(header.digest_alg, region_digests, header.payload_len) != header.payload_digest:
        raise CorruptPayload("payload digest mismatch")


def verify_payload_only(header: SealedHeader, payload, keyring: Keyring | None = None) -> None:
    """Re-check the payload of an already opened header (bytes copied to where they land).

    ``keyring`` is accepted for callers of format 1, whose digests were keyed; format 2
    digests need none.
    """
    _check_tensors(header, None)
    check_payload(header, payload)


def parse_header(header_bytes) -> SealedHeader:
    """Parse a header given without its payload (what a daemon sends a client beside the
    payload it placed elsewhere). Verifies nothing: the daemon checked the signature."""
    view = memoryview(header_bytes).cast("B")
    if view.nbytes < PREFIX_BYTES:
        raise TruncatedState(f"{view.nbytes} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    prefix = _PREFIX.unpack_from(view, 0)
    if prefix[0] != MAGIC:
        raise MalformedState("bad magic: not a statetier sealed object")
    if prefix[4] != view.nbytes:
        raise TruncatedState(f"header length {prefix[4]} but {view.nbytes} header bytes given")
    if prefix[1] not in SUPPORTED_FORMATS:
        raise UnsupportedFormat(f"format version {prefix[1]} (this build reads {sorted(SUPPORTED_FORMATS)})")
    header = _parse(view, prefix)
    _check_tensors(header, None)
    return header


__all__ = [
    "ALIGN", "DigestAlg", "Expectation", "FORMAT_VERSION", "MAGIC", "Opened", "PayloadLayout",
    "SealedHeader", "TensorDescriptor", "VerifiedHeaders", "check_payload", "check_payload_digest", "decode_header", "header_length",
    "layout_payload", "open_sealed", "parse_header", "payload_digest_of", "region_hasher", "seal", "seal_object",
    "verify_payload_only",
]
