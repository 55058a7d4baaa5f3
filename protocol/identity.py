"""Identity of stored state: what an object is, who made it, and what a load expects.

- ``Kind``            — ``KV`` (attention page) or ``SSM`` (recurrent snapshot).
- ``NamespaceSpec``   — what makes states compatible (model, dtypes, layout, tp, hashing,
                        tenant); ``.namespace()`` digests it into a 32-byte ``Namespace``.
- ``StateKey``        — namespace, kind, layer (or group + layer ids), shard, prefix hash,
                        token span. For a snapshot ``token_start == 0`` and
                        ``token_end == tokens_absorbed``.
- ``Provenance``      — request id, step, producer id, created-at.
- ``StateRef``        — StateKey + request id + step + state_id + version + fingerprint:
                        what a put returns and what travels from prefill to decode.
  ``StateKey.from_checked`` / ``StateRef.from_checked`` build them from fields already
  checked (the wire decoder's bounds, the daemon's own values): only cross-field checks.
- ``fingerprint()``, ``stream_id()`` — the digests DESIGN §2 defines.
- ``prefix_hashes()`` / ``prefix_hash()`` — the block-chained hash of token ids.
- ``new_state_id()``  — a random 128-bit id.

All digests are BLAKE2b (stdlib) over a fixed little-endian encoding, so they are stable
across processes, machines and Python versions.
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .errors import InvalidRequest, quote_untrusted

NAMESPACE_BYTES = 32
PREFIX_HASH_BYTES = 32
STATE_ID_BYTES = 16
FINGERPRINT_BYTES = 32
STREAM_ID_BYTES = 16
MAX_U32 = 2**32 - 1
MAX_U64 = 2**64 - 1
MAX_TEXT_BYTES = 255

#: The chain value before any block: the hash of the empty prefix.
EMPTY_PREFIX = bytes(PREFIX_HASH_BYTES)


class Kind(enum.IntEnum):
    KV = 1
    SSM = 2

    @classmethod
    def of_code(cls, code: int) -> "Kind":
        """The kind of a wire code already checked to be 1 or 2 (a dict lookup, not ``Kind(code)``)."""
        return _KINDS[code]

    @classmethod
    def parse(cls, value: "Kind | str | int") -> "Kind":
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise InvalidRequest(f"unknown kind {quote_untrusted(value)}; expected 'kv' or 'ssm'") from None
        try:
            return cls(value)
        except ValueError:
            raise InvalidRequest(f"unknown kind {quote_untrusted(value)}") from None


_KINDS = {1: Kind.KV, 2: Kind.SSM}


def _text(value: str, name: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > MAX_TEXT_BYTES:
        raise InvalidRequest(f"{name} is longer than {MAX_TEXT_BYTES} bytes")
    return raw


def _lp(raw: bytes) -> bytes:
    """Length-prefixed field, so that no two field lists encode to the same bytes."""
    return struct.pack("<I", len(raw)) + raw


def _check_bytes(value: bytes, size: int, name: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != size:
        raise InvalidRequest(f"{name} must be {size} bytes")
    return bytes(value)


def _check_uint(value: int, limit: int, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise InvalidRequest(f"{name} must be an integer in [0, {limit}]")
    return value


@dataclass(frozen=True, slots=True)
class Namespace:
    """The 32-byte digest of a ``NamespaceSpec``; two deployments share objects only if equal."""

    digest: bytes

    def __post_init__(self) -> None:
        _check_bytes(self.digest, NAMESPACE_BYTES, "namespace")

    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def from_hex(cls, text: str) -> "Namespace":
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise InvalidRequest("namespace must be 64 hex digits") from None


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """Everything that decides whether two producers' states are interchangeable."""

    model_id: str
    revision: str = ""
    weight_dtype: str = ""
    quantization: str = ""
    kv_block_size: int = 16
    kv_dtype: str = ""
    ssm_dtype: str = ""
    conv_dtype: str = ""
    conv_layout: str = ""
    tp_size: int = 1
    hash_algorithm: str = "blake2b-chain/1"
    hash_seed: int = 0
    tenant: str = ""

    def namespace(self) -> Namespace:
        parts = [
            b"statetier/namespace/1",
            _text(self.model_id, "model_id"),
            _text(self.revision, "revision"),
            _text(self.weight_dtype, "weight_dtype"),
            _text(self.quantization, "quantization"),
            struct.pack("<Q", _check_uint(self.kv_block_size, MAX_U32, "kv_block_size")),
            _text(self.kv_dtype, "kv_dtype"),
            _text(self.ssm_dtype, "ssm_dtype"),
            _text(self.conv_dtype, "conv_dtype"),
            _text(self.conv_layout, "conv_layout"),
            struct.pack("<Q", _check_uint(self.tp_size, MAX_U32, "tp_size")),
            _text(self.hash_algorithm, "hash_algorithm"),
            struct.pack("<Q", _check_uint(self.hash_seed, MAX_U64, "hash_seed")),
            _text(self.tenant, "tenant"),
        ]
        digest = hashlib.blake2b(b"".join(_lp(p) for p in parts), digest_size=NAMESPACE_BYTES)
        return Namespace(digest.digest())


@dataclass(frozen=True, slots=True)
class StateKey:
    """What an object is. ``layer`` is the layer index, or the group id when ``group_layers``
    names the layers of a group; ``shard`` is the tensor-parallel rank."""

    namespace: Namespace
    kind: Kind
    layer: int
    prefix_hash: bytes
    token_start: int
    token_end: int
    shard: int = 0
    group_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind.parse(self.kind))
        _check_uint(self.layer, MAX_U32, "layer")
        _check_uint(self.shard, 0xFFFF, "shard")
        _check_bytes(self.prefix_hash, PREFIX_HASH_BYTES, "prefix_hash")
        _check_uint(self.token_start, MAX_U64, "token_start")
        _check_uint(self.token_end, MAX_U64, "token_end")
        if self.token_end < self.token_start:
            raise InvalidRequest("token_end must not be below token_start")
        if self.kind is Kind.SSM and self.token_start != 0:
            raise InvalidRequest("an SSM snapshot spans [0, tokens_absorbed): token_start must be 0")
        object.__setattr__(self, "group_layers", tuple(self.group_layers))
        if len(self.group_layers) > 0xFFFF:
            raise InvalidRequest("too many group layers")
        for layer in self.group_layers:
            _check_uint(layer, MAX_U32, "group_layers[]")

    @classmethod
    def from_checked(cls, namespace: Namespace, kind: "Kind", layer: int, prefix_hash: bytes, token_start: int,
                     token_end: int, shard: int = 0, group_layers: tuple[int, ...] = ()) -> "StateKey":
        """A key of fields whose types and ranges were checked already (``protocol.wire_meta``'s
        decoder, or values the daemon derived itself): only the checks across fields run."""
        if token_end < token_start:
            raise InvalidRequest("token_end must not be below token_start")
        if kind is Kind.SSM and token_start != 0:
            raise InvalidRequest("an SSM snapshot spans [0, tokens_absorbed): token_start must be 0")
        if len(group_layers) > 0xFFFF:
            raise InvalidRequest("too many group layers")
        key = object.__new__(cls)
        for name, value in zip(_KEY_FIELDS, (namespace, kind, layer, prefix_hash, token_start, token_end, shard,
                                             group_layers)):
            object.__setattr__(key, name, value)
        return key

    @property
    def tokens_absorbed(self) -> int:
        return self.token_end

    def placement(self) -> tuple[Kind, int, tuple[int, ...], int]:
        return (self.kind, self.layer, self.group_layers, self.shard)

    def position(self) -> tuple[bytes, int, int]:
        return (self.prefix_hash, self.token_start, self.token_end)

    def encode(self) -> bytes:
        """Canonical bytes of the key: a storage address and digest input."""
        return b"".join(
            [
                self.namespace.digest,
                struct.pack("<BIH", int(self.kind), self.layer, self.shard),
                struct.pack(f"<H{len(self.group_layers)}I", len(self.group_layers), *self.group_layers),
                self.prefix_hash,
                struct.pack("<QQ", self.token_start, self.token_end),
            ]
        )

    def digest(self) -> bytes:
        """A 16-byte address of the key (what tiers index objects by)."""
        return hashlib.blake2b(b"statetier/key/1" + self.encode(), digest_size=16).digest()


_KEY_FIELDS = ("namespace", "kind", "layer", "prefix_hash", "token_start", "token_end", "shard", "group_layers")


@dataclass(frozen=True, slots=True)
class Provenance:
    request_id: str
    step: int = 0
    producer_id: str = ""
    created_at_ns: int = 0

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _text(self.producer_id, "producer_id")
        _check_uint(self.step, MAX_U64, "step")
        _check_uint(self.created_at_ns, MAX_U64, "created_at_ns")


def fingerprint(key: StateKey, request_id: str, step: int) -> bytes:
    """DESIGN §2: a hash over (namespace, kind, layer, shard, request id, step, prefix, span)."""
    body = b"statetier/fingerprint/1" + key.encode() + _lp(_text(request_id, "request_id"))
    body += struct.pack("<Q", _check_uint(step, MAX_U64, "step"))
    return hashlib.blake2b(body, digest_size=FINGERPRINT_BYTES).digest()


def stream_id(key: StateKey, request_id: str) -> bytes:
    """One logical object of one request: (namespace, request, kind, layer, shard, span).

    Versions count attempts at the same stream; the prefix hash is deliberately left out,
    so a recompute that hashed differently still supersedes the older attempt.
    """
    body = b"".join(
        [
            b"statetier/stream/1",
            key.namespace.digest,
            _lp(_text(request_id, "request_id")),
            struct.pack("<BIH", int(key.kind), key.layer, key.shard),
            struct.pack(f"<H{len(key.group_layers)}I", len(key.group_layers), *key.group_layers),
            struct.pack("<QQ", key.token_start, key.token_end),
        ]
    )
    return hashlib.blake2b(body, digest_size=STREAM_ID_BYTES).digest()


@dataclass(frozen=True, slots=True)
class StateRef:
    """A handle on one stored object, as returned by a put and passed to a consumer."""

    key: StateKey
    request_id: str
    step: int
    state_id: bytes
    version: int
    fingerprint: bytes = field(default=b"")

    def __post_init__(self) -> None:
        _text(self.request_id, "request_id")
        _check_uint(self.step, MAX_U64, "step")
        _check_bytes(self.state_id, STATE_ID_BYTES, "state_id")
        _check_uint(self.version, MAX_U64, "version")
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", fingerprint(self.key, self.request_id, self.step))
        _check_bytes(self.fingerprint, FINGERPRINT_BYTES, "fingerprint")

    @classmethod
    def from_checked(cls, key: StateKey, request_id: str, step: int, state_id: bytes, version: int,
                     fingerprint: bytes) -> "StateRef":
        """A ref of fields checked already (as ``StateKey.from_checked``); the fingerprint is
        taken as given (a load recomputes it from its expectation, DESIGN §4 step 7)."""
        _text(request_id, "request_id")
        ref = object.__new__(cls)
        for name, value in zip(_REF_FIELDS, (key, request_id, step, state_id, version, fingerprint)):
            object.__setattr__(ref, name, value)
        return ref

    @property
    def stream_id(self) -> bytes:
        return stream_id(self.key, self.request_id)


_REF_FIELDS = ("key", "request_id", "step", "state_id", "version", "fingerprint")


def new_state_id() -> bytes:
    return os.urandom(STATE_ID_BYTES)


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, *, seed: int = 0, include_partial: bool = False,
    extra_keys: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Chained hashes at each block boundary: element i covers tokens ``[0, (i+1)*block_size)``.

    ``h_0 = EMPTY_PREFIX`` (or a seed-derived value), ``h_{i+1} = BLAKE2b-256(h_i ||
    u32 n || n × u32 token)``, n = tokens in the block. Token ids are encoded as u32 little
    endian, so any process on any machine derives the same chain. With ``include_partial``
    a trailing partial block also gets a hash (covering all tokens).

    ``extra_keys[i]`` (bytes; ``b""`` or absent: none) is what else an engine folds into
    block i's identity (DESIGN §2: an adapter, an image, a salt): ``h_{i+1} = BLAKE2b-256(h_i
    || u32 n || n × u32 token || u32 m || m extra bytes)``. A block without extra keys hashes
    exactly as without the argument; one with them never equals one without (the payload is
    longer for the same n).
    """
    if block_size <= 0:
        raise InvalidRequest("block_size must be positive")
    chain = _seed_hash(seed)
    out: list[bytes] = []
    full = len(token_ids) - len(token_ids) % block_size
    end = len(token_ids) if include_partial else full
    extras = list(extra_keys or ())
    for index, start in enumerate(range(0, end, block_size)):
        extra = extras[index] if index < len(extras) else b""
        chain = _chain(chain, token_ids[start : min(start + block_size, end)], extra)
        out.append(chain)
    return out


def prefix_hash(token_ids: Sequence[int], *, block_size: int = 16, seed: int = 0) -> bytes:
    """The chain value covering exactly ``token_ids`` (a partial last block included)."""
    if block_size <= 0:
        raise InvalidRequest("block_size must be positive")
    chain = _seed_hash(seed)
    for start in range(0, len(token_ids), block_size):
        chain = _chain(chain, token_ids[start : start + block_size])
    return chain


def _seed_hash(seed: int) -> bytes:
    if _check_uint(seed, MAX_U64, "seed") == 0:
        return EMPTY_PREFIX
    return hashlib.blake2b(struct.pack("<Q", seed), digest_size=PREFIX_HASH_BYTES).digest()


def _chain(previous: bytes, block: Iterable[int], extra: bytes = b"") -> bytes:
    tokens = list(block)
    for t in tokens:
        _check_uint(t, MAX_U32, "token id")
    payload = previous + struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens)
    if extra:
        if not isinstance(extra, bytes):
            raise InvalidRequest("a block's extra keys must be bytes")
        payload += struct.pack("<I", len(extra)) + extra
    return hashlib.blake2b(payload, digest_size=PREFIX_HASH_BYTES).digest()
