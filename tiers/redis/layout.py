"""How the Redis tier and the version registry lay their data out in Redis.

Keys of one ``prefix`` ("st" by default). ``{…}`` is a hash tag, so every key of one object
lives in one cluster slot and a single pipeline reads or writes it:

    st:{<state_id hex>}:c:<i>   chunk i of the stored bytes: chunk_bytes each, chunk 0 also
                                holding the header (see ``plan_chunks``)
    st:{<state_id hex>}:p:<store>:<i>
                                chunk i of one store in progress, with ``PENDING_CHUNK_TTL``;
                                the commit renames it to ``c:<i>``
    st:{<state_id hex>}:m       the ``Manifest``, written LAST: no manifest, no object
    st:k:{<key_digest hex>}     hash state_id hex → "version:stream_id hex": the key index
    {st}:lru  {st}:sizes  {st}:bytes  {st}:clock  {st}:expiry
                                accounting, one slot: LRU order (score = a tick of
                                ``{st}:clock``), sizes, total bytes, expiry times (with TTL)
    st:v:{<stream_id hex>}      hash version, state_id: a stream's newest attempt
    st:s:{<state_id hex>}       the stream a state_id was claimed for
    {st}:purges                 hash "ns:<namespace hex>" or "tenant:<name>" → ns since epoch:
                                cluster-wide purge marks (objects created up to then are gone)

- ``RedisKeys``   — the names above for one prefix.
- ``CHUNK_BYTES``, ``INLINE_BYTES`` — the default chunk size; the size up to which an object
  is sealed and verified on the event loop.
- ``Manifest``    — an object's summary (ObjectMeta + how its bytes are chunked + the store
  that wrote it), as JSON; ``decode_manifest(raw)`` decodes with a bounded memo;
  ``stored_under(manifest, oid)`` reads it as the description of the keys of ``oid``.
- ``plan_chunks`` — splits the writer's buffers into chunks (slices, no copy); chunk 0 also
  holds the header.
- ``join_chunks`` — reassembles chunks into one buffer. It does not judge the length: the
  sealed header inside declares its own sizes, and the reader checks the bytes against
  those (an intact object of another size under this id is a mix-up, not a truncation).

Pending chunks carry their store's id, so neither a SET that reaches Redis after the
cleanup of a cancelled store nor a second store of the same object id can touch the chunks
of a committed object; they expire with ``PENDING_CHUNK_TTL``. The scripts that commit and
account are in ``tiers.redis.scripts``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, fields
from typing import Any, Sequence

from statetier.protocol.errors import ConfigError, CorruptPayload
from statetier.protocol.identity import Kind
from statetier.protocol.passes import PASSES
from ..base import Buffer, ObjectMeta
from .connect import Gathered

MANIFEST_FORMAT = 1
PENDING_CHUNK_TTL = 600  # seconds an uncommitted chunk may live
CHUNK_BYTES = 2 << 20  # the default chunk size
# Objects up to this size are verified (and sealed at rest) on the event loop: a hash of
# 256 KiB costs less than an executor hop.
INLINE_BYTES = 256 << 10
_GLOB_SPECIALS = "*?[]\\"


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{}") or any(c.isspace() for c in self.prefix):
            raise ConfigError("key_prefix must be non-empty, without braces or whitespace")

    def manifest(self, object_id: bytes) -> str:
        return f"{self.prefix}:{{{object_id.hex()}}}:m"

    def chunk(self, object_id: bytes, index: int) -> str:
        return f"{self.prefix}:{{{object_id.hex()}}}:c:{index}"

    def chunks(self, object_id: bytes, count: int) -> list[str]:
        return [self.chunk(object_id, i) for i in range(count)]

    def pending_chunks(self, object_id: bytes, store_id: str, count: int) -> list[str]:
        return [f"{self.prefix}:{{{object_id.hex()}}}:p:{store_id}:{i}" for i in range(count)]

    def object_id_of(self, manifest_key: bytes | str) -> bytes:
        """The object id a manifest key (``manifest``) names."""
        text = manifest_key.decode() if isinstance(manifest_key, bytes) else manifest_key
        return bytes.fromhex(text[len(self.prefix) + 2 : -3])

    def manifest_pattern(self) -> str:
        """A SCAN pattern matching every manifest of this prefix."""
        escaped = "".join("\\" + c if c in _GLOB_SPECIALS else c for c in self.prefix)
        return escaped + ":{*}:m"

    def key_index(self, key_digest: bytes) -> str:
        return f"{self.prefix}:k:{{{key_digest.hex()}}}"

    def accounting(self) -> list[str]:
        """KEYS of ``ACCOUNTING_LUA``: lru, sizes, bytes, clock, expiry."""
        tag = f"{{{self.prefix}}}"
        return [f"{tag}:lru", f"{tag}:sizes", f"{tag}:bytes", f"{tag}:clock", f"{tag}:expiry"]

    def stream_head(self, stream_id: bytes) -> str:
        return f"{self.prefix}:v:{{{stream_id.hex()}}}"

    def stream_of(self, state_id: bytes) -> str:
        return f"{self.prefix}:s:{{{state_id.hex()}}}"

    def purges(self) -> str:
        return f"{{{self.prefix}}}:purges"


@dataclass(frozen=True, slots=True)
class Manifest:
    meta: ObjectMeta
    stored_size: int  # bytes in Redis: the sealed object, or its at-rest envelope
    chunks: int
    chunk_bytes: int
    is_encrypted: bool
    store_id: str = ""  # the store that wrote it: what a rollback checks before deleting

    def encode(self) -> bytes:
        meta = {name: to_json(getattr(self.meta, name)) for name, to_json in _META_TO_JSON}
        return _ENCODER.encode({
            "format": MANIFEST_FORMAT, "meta": meta, "stored_size": self.stored_size,
            "chunks": self.chunks, "chunk_bytes": self.chunk_bytes, "encrypted": self.is_encrypted,
            "store": self.store_id,
        }).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Manifest":
        """Parse a manifest; anything malformed is ``CorruptPayload``."""
        try:
            d = json.loads(raw)
            if d["format"] != MANIFEST_FORMAT:
                raise ValueError(f"manifest format {d['format']}")
            meta = ObjectMeta(**{name: _from_json(name, value) for name, value in d["meta"].items()
                                 if name in _META_FIELDS})
            manifest = cls(meta, int(d["stored_size"]), int(d["chunks"]), int(d["chunk_bytes"]),
                           bool(d["encrypted"]), str(d.get("store", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptPayload(f"unreadable manifest in redis: {exc}") from exc
        if not 1 <= manifest.chunks <= max(1, manifest.stored_size):
            raise CorruptPayload("manifest chunk count does not fit its size")
        return manifest

    @classmethod
    def try_decode(cls, raw: bytes | None) -> "Manifest | None":
        if raw is None:
            return None
        try:
            return cls.decode(raw)
        except CorruptPayload:
            return None


@functools.lru_cache(maxsize=4096)
def decode_manifest(raw: bytes) -> Manifest:
    """``Manifest.decode``, remembered: an object read again has the same manifest bytes."""
    return Manifest.decode(raw)


def stored_under(manifest: Manifest | None, oid: bytes) -> Manifest | None:
    """The manifest as a description of what is stored under ``oid``: a manifest naming
    another object (a writer that mixed up keys) still describes *these* keys; what the
    object really is, is for the reader to judge from the bytes."""
    if manifest is None or manifest.meta.object_id == oid:
        return manifest
    return dataclasses.replace(manifest, meta=dataclasses.replace(manifest.meta, object_id=oid))




_META_FIELDS = tuple(f.name for f in fields(ObjectMeta))
_BYTES_FIELDS = frozenset({"object_id", "key_digest", "stream_id", "namespace"})
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _same(value: Any) -> Any:
    return value


_META_TO_JSON = tuple((name, bytes.hex if name in _BYTES_FIELDS else int if name == "kind" else _same)
                      for name in _META_FIELDS)


def _from_json(name: str, value: Any) -> Any:
    if name in _BYTES_FIELDS:
        return bytes.fromhex(value)
    return Kind(value) if name == "kind" else value


def plan_chunks(buffers: Sequence[Buffer], chunk_bytes: int, head_bytes: int = 0) -> list[memoryview | Gathered]:
    """The chunk values to SET, in order: slices of the writer's buffers, never copied (a
    chunk that spans buffers is ``Gathered`` from several slices).

    Chunk 0 holds the first ``head_bytes + chunk_bytes`` bytes (the sealed header and the
    first ``chunk_bytes`` of the payload, so a page of exactly ``chunk_bytes`` is one value
    that reads back without a join); every later chunk ``chunk_bytes``, the last what is left.
    """
    views = [view for view in (memoryview(buffer).cast("B") for buffer in buffers) if view.nbytes]
    chunks: list[list[memoryview]] = []
    current: list[memoryview] = []
    room = head_bytes + chunk_bytes
    for view in views:
        while view.nbytes:
            take = min(room, view.nbytes)
            current.append(view[:take])
            view, room = view[take:], room - take
            if not room:
                chunks.append(current)
                current, room = [], chunk_bytes
    if current or not chunks:
        chunks.append(current)
    return [parts[0] if len(parts) == 1 else Gathered(tuple(parts)) for parts in chunks]


def join_chunks(parts: Sequence[bytes]) -> memoryview:
    """One buffer holding ``parts`` back to back (no copy for a single part; else one copy,
    without zero-filling a buffer first)."""
    if len(parts) == 1:
        return memoryview(parts[0])
    joined = b"".join(parts)
    PASSES.count_copied(len(joined))
    return memoryview(joined)
