"""The sealed object's byte layout and the codec of its header (docs/protocol.md §2).

- ``MAGIC``, ``FORMAT_VERSION``, ``SUPPORTED_FORMATS``, ``RETIRED_FORMATS``, ``ALIGN``,
  ``FLAG_SPECULATIVE`` / ``FLAG_SEALED``, ``PREFIX_BYTES``, ``FIXED_BYTES`` — the format's
  constants; the struct formats are ``_PREFIX`` / ``_BODY`` / ``_TENSOR_*`` below.
- ``layout_payload(specs)`` → ``PayloadLayout``: each tensor's offset (64-byte aligned),
  its region (tensor + padding) and the payload length.
- ``SealedHeader`` (with one ``TensorDescriptor`` per tensor): the parsed header;
  ``ref()``, ``stream_id``, ``describe()`` for ``statetier inspect``.
- ``encode_header(...)`` / ``header_length(...)`` — the signed header bytes, and their
  length known before any digest (zero-copy puts reserve header + payload at once).
- ``read_prefix(view)``, ``frame_object(blob)``, ``parse_fields(view, prefix)``,
  ``decode_header(blob)`` — the way back; they check framing and parse, never verify.

``sealed`` seals and opens with these; it is the path users import them from.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

from . import dtypes
from .digests import Bytes, DigestAlg
from .dtypes import TensorSpec
from .errors import InvalidRequest, MalformedState, TruncatedState
from .identity import Kind, Namespace, Provenance, StateKey, StateRef, fingerprint, stream_id
from .keyring import SigAlg, SigningKey

MAGIC = b"STSO"
FORMAT_VERSION = 3
SUPPORTED_FORMATS = frozenset({3})
#: Retired formats, refused with ``UnsupportedFormat`` (and this reason) after their signature
#: verified, never read with today's rules. Format 1 bound *keyed* BLAKE3 digests (a verifier
#: needed the signing key). Format 2 has format 3's bytes, but its namespace is the one the
#: client named, which any tenant could name: format 3's is the namespace the sealing daemon's
#: authenticated tenant owns (``protocol.ownership``).
RETIRED_FORMATS = {
    1: "format 1 bound keyed payload digests; re-put the object to reseal it unkeyed",
    2: "format 2 sealed the namespace its client named, which any tenant could claim; re-put the object "
       "so that the daemon seals it in its tenant's own namespace",
}
ALIGN = 64
DIGEST_BYTES = 32

FLAG_SPECULATIVE = 0x01
FLAG_SEALED = 0x02
_KNOWN_FLAGS = FLAG_SPECULATIVE | FLAG_SEALED

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

    def describe(self) -> dict[str, Any]:
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


def encode_header(key: StateKey, provenance: Provenance, layout: PayloadLayout, region_digests: Sequence[bytes],
                  payload_digest: bytes, signer: SigningKey, state_id: bytes, version: int, digest_alg: DigestAlg,
                  flags: int, fingerprint_bytes: bytes | None = None) -> bytes:
    """The signed header of ``layout``'s payload, given its region and payload digests
    (and the identity's fingerprint, computed here unless given)."""
    request_id = provenance.request_id.encode()
    producer = provenance.producer_id.encode()
    parts = [
        b"",  # prefix, filled below once the length is known
        _BODY.pack(
            int(key.kind), flags, key.shard, key.layer, key.namespace.digest, key.prefix_hash,
            key.token_start, key.token_end, provenance.step, provenance.created_at_ns, state_id,
            version, fingerprint_bytes or fingerprint(key, provenance.request_id, provenance.step), payload_digest,
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


def read_prefix(view: memoryview) -> tuple[Any, ...]:
    """The fixed prefix of a header, once its length and magic are right."""
    if view.nbytes < PREFIX_BYTES:
        raise TruncatedState(f"{view.nbytes} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    prefix = _PREFIX.unpack_from(view, 0)
    if prefix[0] != MAGIC:
        raise MalformedState("bad magic: not a statetier sealed object")
    return prefix


def frame_object(blob: Bytes) -> tuple[memoryview, tuple[Any, ...]]:
    """``header + payload`` as a byte view and its prefix, once the lengths add up."""
    view = memoryview(blob).cast("B")
    prefix = read_prefix(view)
    _magic, _fmt, _sig, _dig, header_len, _res, payload_len, _kid = prefix
    if header_len < PREFIX_BYTES or header_len > view.nbytes:
        raise TruncatedState(f"header length {header_len} does not fit in {view.nbytes} bytes")
    if payload_len != view.nbytes - header_len:
        raise TruncatedState(f"payload length {payload_len} but {view.nbytes - header_len} bytes present")
    return view, prefix


def decode_header(blob: Bytes) -> SealedHeader:
    """Parse a header without verifying it; raises ``TruncatedState`` / ``MalformedState``."""
    view, prefix = frame_object(blob)
    return parse_fields(view, prefix)


def parse_fields(view: memoryview, prefix: tuple[Any, ...]) -> SealedHeader:
    """The header after its ``prefix`` (from ``frame_object`` / ``read_prefix``), parsed;
    ``MalformedState`` when its fields do not parse or overrun ``header_len``."""
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
