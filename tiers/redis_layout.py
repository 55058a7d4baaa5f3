"""How the Redis tier and the version registry lay their data out in Redis.

Keys of one ``prefix`` ("st" by default). ``{…}`` is a hash tag, so every key of one object
lives in one cluster slot and a single pipeline reads or writes it:

    st:{<state_id hex>}:c:<i>   chunk i of the stored bytes (at most chunk_bytes each)
    st:{<state_id hex>}:m       the ``Manifest``, written LAST: no manifest, no object
    st:k:{<key_digest hex>}     hash state_id hex → version: the key index of find_by_key
    {st}:lru  {st}:sizes  {st}:bytes  {st}:clock  {st}:expiry
                                accounting, one slot: LRU order (score = a tick of
                                ``{st}:clock``), sizes, total bytes, expiry times (with TTL)
    st:v:{<stream_id hex>}      hash version, state_id: a stream's newest attempt
    st:s:{<state_id hex>}       the stream a state_id was claimed for

- ``RedisKeys``   — the names above for one prefix.
- ``Manifest``    — an object's summary (ObjectMeta + how its bytes are chunked), as JSON.
- ``plan_chunks`` — splits the writer's buffers into chunks without copying large ones.
- ``join_chunks`` — reassembles chunks into one preallocated buffer.
- ``COMMIT_LUA``  — writes the manifest only if every chunk is still there, and gives the
  chunks their final TTL (until then they carry ``PENDING_CHUNK_TTL``, so chunks of a store
  that died, or a SET that reached Redis after the cleanup of a cancelled one, expire).
- ``ACCOUNTING_LUA`` — add / touch / remove / status of the accounting keys, atomically,
  pruning entries whose TTL has passed (expired objects leave no trace in the budget).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Sequence

from statetier.protocol.errors import ConfigError, CorruptPayload, TruncatedState
from statetier.protocol.identity import Kind
from statetier.tiers.base import Buffer, ObjectMeta

MANIFEST_FORMAT = 1
PENDING_CHUNK_TTL = 600  # seconds an uncommitted chunk may live
# Writer buffers below this size are coalesced (copied) into one chunk; larger ones are
# sent as memoryview slices, never copied.
SMALL_PIECE_BYTES = 64 << 10
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


@dataclass(frozen=True, slots=True)
class Manifest:
    meta: ObjectMeta
    stored_size: int  # bytes in Redis: the sealed object, or its at-rest envelope
    chunks: int
    chunk_bytes: int
    is_encrypted: bool

    def encode(self) -> bytes:
        meta = {f.name: _to_json(getattr(self.meta, f.name)) for f in fields(ObjectMeta)}
        return json.dumps({
            "format": MANIFEST_FORMAT, "meta": meta, "stored_size": self.stored_size,
            "chunks": self.chunks, "chunk_bytes": self.chunk_bytes, "encrypted": self.is_encrypted,
        }, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Manifest":
        """Parse a manifest; anything malformed is ``CorruptPayload``."""
        try:
            d = json.loads(raw)
            if d["format"] != MANIFEST_FORMAT:
                raise ValueError(f"manifest format {d['format']}")
            meta = ObjectMeta(**{f.name: _from_json(f.name, d["meta"][f.name])
                                 for f in fields(ObjectMeta) if f.name in d["meta"]})
            manifest = cls(meta, int(d["stored_size"]), int(d["chunks"]), int(d["chunk_bytes"]),
                           bool(d["encrypted"]))
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


_BYTES_FIELDS = frozenset({"object_id", "key_digest", "stream_id"})


def _to_json(value):
    return value.hex() if isinstance(value, bytes) else int(value) if isinstance(value, Kind) else value


def _from_json(name: str, value):
    if name in _BYTES_FIELDS:
        return bytes.fromhex(value)
    return Kind(value) if name == "kind" else value


def plan_chunks(buffers: Sequence[Buffer], chunk_bytes: int) -> list[Buffer]:
    """The values to SET, in order: each at most ``chunk_bytes``; their join is the input.

    Chunk boundaries follow the writer's buffers so that large buffers are sent as
    memoryview slices (redis-py writes those to the socket without a copy); only runs of
    small buffers (a header, a few tiny tensors) are copied into one chunk.
    """
    out: list[Buffer] = []
    pending = bytearray()
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        if view.nbytes < SMALL_PIECE_BYTES and len(pending) + view.nbytes <= chunk_bytes:
            pending += view
            continue
        if pending:
            out.append(bytes(pending))
            pending = bytearray()
        for start in range(0, view.nbytes, chunk_bytes):
            out.append(view[start : start + chunk_bytes])
    if pending or not out:
        out.append(bytes(pending))
    return out


def join_chunks(parts: Sequence[bytes], size: int) -> memoryview:
    """One buffer holding ``parts`` back to back; ``TruncatedState`` unless they fill ``size``."""
    if len(parts) == 1:
        if len(parts[0]) != size:
            raise TruncatedState(f"stored object is {len(parts[0])} bytes; its manifest says {size}")
        return memoryview(parts[0])
    if sum(len(p) for p in parts) != size:
        raise TruncatedState(f"stored chunks hold {sum(len(p) for p in parts)} bytes; the manifest says {size}")
    whole = memoryview(bytearray(size))
    offset = 0
    for part in parts:
        whole[offset : offset + len(part)] = part
        offset += len(part)
    return whole


# KEYS: manifest, then every chunk (one slot). ARGV: manifest bytes, ttl seconds (0 = none).
# Returns 1 when committed, 0 when a chunk is missing, -1 when a manifest exists already.
COMMIT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    return 0
  end
end
local ttl = tonumber(ARGV[2])
for i = 2, #KEYS do
  if ttl > 0 then
    redis.call('EXPIRE', KEYS[i], ttl)
  else
    redis.call('PERSIST', KEYS[i])
  end
end
if ttl > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
else
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""


# KEYS: lru, sizes, bytes, clock, expiry.  ARGV: op, id (hex), size, ttl seconds (0 = none).
# Returns {changed, bytes, objects}. ``changed`` is 1 when this call added or removed the
# entry (so of two nodes evicting one object, exactly one wins) or moved it in LRU order.
ACCOUNTING_LUA = """
local function drop(id)
  local size = redis.call('HGET', KEYS[2], id)
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[5], id)
  if size then
    redis.call('HDEL', KEYS[2], id)
    redis.call('DECRBY', KEYS[3], size)
    return 1
  end
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, 128)) do
  drop(id)
end
local op, id, changed = ARGV[1], ARGV[2], 0
if op == 'add' then
  if redis.call('HSETNX', KEYS[2], id, ARGV[3]) == 1 then
    redis.call('INCRBY', KEYS[3], ARGV[3])
    changed = 1
  end
  redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), id)
  local ttl = tonumber(ARGV[4])
  if ttl > 0 then
    redis.call('ZADD', KEYS[5], string.format('%.6f', now + ttl), id)
  end
elseif op == 'touch' then
  changed = redis.call('ZADD', KEYS[1], 'XX', 'CH', redis.call('INCR', KEYS[4]), id)
elseif op == 'remove' then
  changed = drop(id)
end
return {changed, tonumber(redis.call('GET', KEYS[3]) or '0'), redis.call('ZCARD', KEYS[1])}
"""
