"""The Redis tier: sealed objects in Redis or Redis Cluster, shared by every node.

``RedisTier`` is the ``Tier`` of DESIGN §5; ``tiers.redis.connect`` opens its client,
``tiers.redis.layout`` names its keys, ``tiers.redis.scripts`` holds its Lua scripts,
``tiers.redis.errors`` translates what redis-py raises.

- store: the chunks go to pending keys named after the store, as slices of the writer's
  buffers (never copied; chunk 0 also holds the header, so a 2 MiB page is one chunk). An
  object of one chunk is sent by ``complete_store`` together with the commit, one round
  trip in all: the caller keeps the buffers it gave ``write`` unchanged until
  ``complete_store`` returns (``Placement.store_in`` does); ``write`` sends larger ones.
  The Lua commit renames the pending chunks and writes the manifest LAST, only if no
  manifest exists and every chunk is there; on a single server the same script updates the
  key index and the accounting (a cluster keeps those in other slots: one more round trip
  after the commit). No manifest, no object; a failed or cancelled store deletes its
  pending chunks, and any SET that lands after that expires with ``PENDING_CHUNK_TTL``
  without touching another store's keys.
- duplicates: ``prepare_store`` refuses, after one EXISTS, an object this node has seen
  stored; the commit refuses one stored by another node (``InvalidRequest`` either way).
- lookup: ``find_by_keys`` answers many key digests in two round trips in all: the
  HGETALLs of their key indexes, then the GETs of every manifest they name together with
  the stream heads of the registry (when it lives on this server: the index entry holds
  the object's version and stream id, so the heads are known before the manifests).
  Index entries whose manifest is gone are pruned (one more round trip, only then).
- read: ``prepare_load`` takes the manifest a ``find_by_keys`` of this instance fetched
  less than ``FOUND_FRESH_S`` ago (once: a lookup's lease costs no round trip and holds no
  payload), or fetches it together with the first ``PREFETCH_BYTES`` of chunk 0 (one
  round trip: an object that small is then read with no other; a larger one's read
  fetches chunk 0 again, at most ``PREFETCH_BYTES`` wasted). ``read`` fetches the chunks
  not held in one round trip, over up to ``FETCH_CONNECTIONS`` connections at once (the LRU
  touch rides along when there is a budget), reassembles, decrypts (``AtRestCipher``) and checks integrity (``tiers.redis.verify``:
  the lengths the header declares, signature, payload digest; never the manifest): on the
  event loop up to ``INLINE_BYTES``, in the executor above. A damaged object is deleted
  and counted (``extra["corrupt_dropped"]``); an intact object of another identity is
  returned as found, for the engine to classify (``protocol.classify``); chunks gone
  under a lease are ``NotFound``.
- every hot-path round trip is one ``connect.exchange``.
- leases are local to this instance; ``delete`` under a lease removes the manifest at once
  and the chunks at the last release. ``evict`` walks the LRU order shared by every node
  on the prefix and claims each victim atomically, so two nodes never both take one.
- ``stats()``: objects and bytes_used of the whole prefix (all nodes) as of the last
  accounting call; capacity 0 = no budget; ``extra["available"]`` = the last call reached
  Redis. A failure to reach Redis is ``Unavailable``, wrong credentials ``Unauthorized``.

Public beyond ``Tier``: ``client`` (for a ``RedisVersionRegistry`` sharing the connection),
``is_cluster``, ``is_available``, ``key_prefix``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from redis.asyncio import Redis, RedisCluster

from statetier.protocol.errors import (
    CapacityError,
    ConfigError,
    CorruptPayload,
    InternalError,
    InvalidRequest,
    NotFound,
    RejectedState,
    StatetierError,
)
from statetier.protocol.keyring import Keyring
from ..base import (
    Buffer,
    EvictedObject,
    KeyMatches,
    Lease,
    LeaseTable,
    ObjectMeta,
    StoreTicket,
    Tier,
    TierStats,
)
from ..crypto import AtRestCipher
from ..registry import VersionRegistry
from .connect import exchange, open_client
from .errors import RedisEdge
from .layout import (
    PENDING_CHUNK_TTL,
    Manifest,
    RedisKeys,
    decode_manifest,
    join_chunks,
    plan_chunks,
)
from .registry import RedisVersionRegistry
from .scripts import Scripts
from .verify import VerifiedHeaders

CHUNK_BYTES = 2 << 20
# Objects up to this size are verified (and sealed at rest) on the event loop: a hash of
# 256 KiB costs less than an executor hop.
INLINE_BYTES = 256 << 10
_EVICT_BATCH = 32
_PROBE_BATCH = 16  # chunk keys deleted per round trip when the count is unknown
_KNOWN_IDS = 1 << 16  # object ids remembered as stored, for prepare_store's refusal
# A manifest find_by_keys fetched serves one prepare_load for this long: the lookup that
# found it leases it at once. A lease trusts its manifest for its whole TTL anyway (leases
# are local; a read whose chunks are gone is NotFound), so this adds no new staleness.
FOUND_FRESH_S = 1.0
FETCH_CONNECTIONS = 4  # the chunks of one object are read over this many connections at once
PREFETCH_BYTES = 128 << 10  # of chunk 0, fetched by a lease that did not come from a lookup
_FOUND_KEPT = 1 << 14


@dataclass(frozen=True, slots=True)
class _Leased:
    manifest: Manifest
    head: bytes | None = None  # the first bytes of chunk 0, fetched with the manifest
    touched: bool = False  # the LRU touch rode with the manifest: the read need not touch


@dataclass(slots=True)
class _PendingStore:
    store_id: str  # names its pending chunk keys and goes into the manifest
    chunks: int = 0  # pending chunk keys this store may have written (what cleanup deletes)
    stored_size: int = 0
    staged: list | None = None  # the chunk values that go with the commit (not sent by write)


class RedisTier(Tier):
    verifies_on_read = True  # read() checks every object's signature (tiers.redis.verify) and digest

    def __init__(self, url: str, *, keyring: Keyring, cluster: bool | None = None,
                 key_prefix: str = "st", chunk_bytes: int = CHUNK_BYTES,
                 ttl_seconds: int | None = None, capacity_bytes: int | None = None,
                 high_watermark: float = 0.9, low_watermark: float = 0.75,
                 lease_ttl: float = 30.0, cipher: AtRestCipher | None = None,
                 socket_timeout: float = 5.0, retries: int = 3,
                 executor: concurrent.futures.Executor | None = None, name: str = "redis") -> None:
        if chunk_bytes < 1:
            raise ConfigError("chunk_bytes must be positive")
        if ttl_seconds is not None and ttl_seconds < 1:
            raise ConfigError("ttl_seconds must be at least 1 (or None for no expiry)")
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ConfigError("capacity_bytes must be positive (or None for no budget)")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ConfigError("watermarks need 0 < low_watermark <= high_watermark <= 1")
        self.name = name
        self._url, self._cluster, self._keyring, self._cipher = url, cluster, keyring, cipher
        self.key_prefix = key_prefix
        self._keys = RedisKeys(key_prefix)
        self._accounting_keys = self._keys.accounting()
        self._chunk_bytes, self._ttl, self._capacity = chunk_bytes, ttl_seconds, capacity_bytes
        self._high, self._low = high_watermark, low_watermark
        self._socket_timeout, self._retries = socket_timeout, retries
        self._executor, self._owns_executor = executor, executor is None
        self._client: Redis | RedisCluster | None = None
        self._scripts: Scripts | None = None
        self.is_cluster: bool | None = None
        self._edge = RedisEdge()
        self._leases = LeaseTable(lease_ttl)
        self._verified = VerifiedHeaders(keyring, size=2048)
        self._leased: dict[bytes, ObjectMeta] = {}  # objects under a local lease
        self._leased_found: dict[bytes, _Leased] = {}  # their manifests, shared by leases
        self._found: OrderedDict[bytes, tuple[Manifest, float]] = OrderedDict()  # by find_by_keys, when
        self._doomed: dict[bytes, Manifest] = {}  # deleted while leased: chunks go at the last release
        self._stores: dict[int, StoreTicket] = {}
        self._storing: set[bytes] = set()
        self._ticket_ids = itertools.count(1)
        self._known: OrderedDict[bytes, None] = OrderedDict()  # seen stored (most recent last)
        self._reserved = 0
        self._objects = self._bytes_used = 0  # as Redis reported on the last accounting call
        self._evictions = self._corrupt_dropped = self._stale_pruned = 0

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._client is not None:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"{self.name}-tier")
        with self._edge.call("connect"):
            client, self.is_cluster = await open_client(
                self._url, cluster=self._cluster, socket_timeout=self._socket_timeout, retries=self._retries)
        self._scripts = Scripts(client)
        try:
            self._client = client
            with self._edge.call("connect"):
                await self._scripts.load_all()
            await self._account("status")  # also proves the ACL user may touch our keys
        except BaseException:
            self._client = None
            await client.aclose()
            raise

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            for ticket in list(self._stores.values()):
                self._stores.pop(ticket.ticket_id, None)
                await self._try_drop_pending(client, ticket.meta.object_id, ticket.location)
            self._storing.clear()
            self._reserved = 0
            for oid, manifest in list(self._doomed.items()):  # our leases end with us
                await self._try_erase(client, oid, manifest, manifest.chunks)
            self._doomed.clear()
            await client.aclose()
        if self._owns_executor and self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @property
    def client(self) -> Redis | RedisCluster:
        if self._client is None:
            raise RuntimeError(f"tier {self.name!r} is not started (or already closed)")
        return self._client

    @property
    def is_available(self) -> bool:
        return self._edge.is_available

    # -- store -------------------------------------------------------------------------

    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket:
        client = self.client
        oid = meta.object_id
        if oid in self._storing or oid in self._doomed:
            raise InvalidRequest(f"object {oid.hex()} is already being stored or deleted")
        unevictable = self._reserved + sum(m.size for m in self._leased.values())
        if self._capacity is not None and meta.size + unevictable > self._capacity:
            raise CapacityError(f"{meta.size} bytes do not fit in the {self.name} tier: {unevictable} of "
                                f"{self._capacity} bytes are reserved or leased", tier=self.name, need=meta.size)
        self._storing.add(oid)
        try:
            if oid in self._known:  # seen stored: confirm, another node may have deleted it since
                with self._edge.call("prepare_store"):
                    (exists,) = await exchange(client, [("EXISTS", self._keys.manifest(oid))])
                    _raise_first_error([exists])
                if exists:
                    raise InvalidRequest(f"object {oid.hex()} is already stored")
                self._known.pop(oid, None)
        except BaseException:
            self._storing.discard(oid)
            raise
        ticket = StoreTicket(meta, next(self._ticket_ids), location=_PendingStore(os.urandom(6).hex()))
        self._stores[ticket.ticket_id] = ticket
        self._reserved += meta.size
        return ticket

    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None:
        client, pending = self.client, self._pending(ticket)
        if pending.chunks or ticket.written:
            raise InvalidRequest("write() was already called for this ticket")
        size = sum(memoryview(c).nbytes for c in chunks)
        if size != ticket.meta.size:
            raise InvalidRequest(f"write got {size} bytes; the object is {ticket.meta.size}")
        head = ticket.meta.header_len
        if self._cipher is not None:  # the envelope is ours: it waits for the commit
            envelope = (self._cipher.seal_envelope(b"".join(chunks)) if size <= INLINE_BYTES
                        else await self._run(lambda: self._cipher.seal_envelope(b"".join(chunks))))
            pieces = pending.staged = plan_chunks([envelope], self._chunk_bytes, head)
            size = len(envelope)
        else:
            pieces = plan_chunks(chunks, self._chunk_bytes, head)
            if len(pieces) == 1:  # goes with the commit; the caller keeps its buffers until then
                pending.staged = pieces
        pending.chunks, pending.stored_size = len(pieces), size
        if pending.staged is None:
            oid = ticket.meta.object_id
            try:
                with self._edge.call("write"):
                    _raise_first_error(await exchange(client, _sets(self._pending_keys(oid, pending), pieces)))
            except StatetierError:
                await self._try_drop_pending(client, oid, pending)
                raise
        ticket.written = ticket.meta.size

    async def complete_store(self, ticket: StoreTicket, success: bool) -> None:
        if self._stores.pop(ticket.ticket_id, None) is None:
            return  # completed before (or never ours): nothing is held
        meta, pending = ticket.meta, ticket.location
        self._reserved -= meta.size
        self._storing.discard(meta.object_id)
        client = self.client
        if not success or ticket.written != meta.size:
            await self._try_drop_pending(client, meta.object_id, pending)
            if success:
                raise InvalidRequest("complete_store(success=True) before the object was written")
            return
        manifest = Manifest(meta, pending.stored_size, pending.chunks, self._chunk_bytes,
                            self._cipher is not None, pending.store_id)
        try:
            committed = await self._commit(client, manifest, pending)
        except BaseException:
            await self._try_roll_back(client, manifest, pending)
            raise
        if committed == 0:
            raise InternalError(f"chunks of {meta.object_id.hex()} vanished before the commit "
                                "(redis maxmemory eviction?)")
        self._remember(meta.object_id, True)
        if committed == -1:  # another node stored this state_id meanwhile: its object stands
            raise InvalidRequest(f"object {meta.object_id.hex()} is already stored")

    async def _commit(self, client, manifest: Manifest, pending: _PendingStore) -> int:
        """Send the staged chunks (if any) and the commit; 1, 0 (a chunk is gone) or -1 (exists)."""
        meta, oid = manifest.meta, manifest.meta.object_id
        pending_keys = self._pending_keys(oid, pending)
        moves = [*pending_keys, *self._keys.chunks(oid, pending.chunks)]
        ttl = self._ttl or 0
        if self.is_cluster:  # the key index and the accounting live in other slots
            name, keys, args = "commit", [self._keys.manifest(oid), *moves], [manifest.encode(), ttl]
        else:
            name = "commit_indexed"
            keys = [self._keys.manifest(oid), self._keys.key_index(meta.key_digest), *self._accounting_keys, *moves]
            args = [manifest.encode(), ttl, oid.hex(), meta.size, index_value(meta)]
        sets = [] if pending.staged is None else _sets(pending_keys, pending.staged)
        with self._edge.call("complete_store"):
            replies = await exchange(client, [*sets, self._scripts.command(name, keys, args)])
            _raise_first_error(replies[:-1])
            reply = await self._scripts.result_of(replies[-1], name, keys, args)
            committed = int(reply[0])
            if committed == 1 and self.is_cluster:
                reply = await self._index_and_account(client, meta)
        if committed == 1:
            self._bytes_used, self._objects = int(reply[1]), int(reply[2])
        return committed

    async def _index_and_account(self, client, meta: ObjectMeta) -> list:
        """Cluster only: the key index entry and the accounting "add", in one round trip."""
        index, keys = self._keys.key_index(meta.key_digest), self._accounting_keys
        args = ["add", meta.object_id.hex(), meta.size, self._ttl or 0]
        commands = [("HSET", index, meta.object_id.hex(), index_value(meta))]
        if self._ttl:
            commands.append(("EXPIRE", index, self._ttl))
        replies = await exchange(client, [*commands, self._scripts.command("accounting", keys, args)])
        _raise_first_error(replies[:-1])
        return await self._scripts.result_of(replies[-1], "accounting", keys, args)

    def _pending(self, ticket: StoreTicket) -> _PendingStore:
        if self._stores.get(ticket.ticket_id) is not ticket:
            raise InvalidRequest(f"store ticket {ticket.ticket_id} is not open")
        return ticket.location

    def _pending_keys(self, oid: bytes, pending: _PendingStore) -> list[str]:
        return self._keys.pending_chunks(oid, pending.store_id, pending.chunks)

    async def _try_drop_pending(self, client, oid: bytes, pending: _PendingStore) -> None:
        """Delete the pending chunks ``write`` sent (best effort: they expire anyway)."""
        if pending.staged is not None or not pending.chunks:
            return  # nothing was sent
        try:
            with self._edge.call("delete"):
                await client.delete(*self._pending_keys(oid, pending))
        except StatetierError:
            pass

    async def _try_roll_back(self, client, manifest: Manifest, pending: _PendingStore) -> None:
        """After a commit that failed or was cancelled midway: drop the pending chunks and,
        when the commit did land, the object (only if its manifest names this store)."""
        oid = manifest.meta.object_id
        try:
            with self._edge.call("delete"):
                replies = await exchange(client, [("DEL", *self._pending_keys(oid, pending)),
                                                  ("GET", self._keys.manifest(oid))])
                _raise_first_error(replies)
            found = Manifest.try_decode(replies[1])
        except StatetierError:
            return
        if found is not None and found.store_id == manifest.store_id:
            await self._try_erase(client, oid, found, found.chunks)

    # -- load --------------------------------------------------------------------------

    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease:
        client = self.client
        await self._expire_leases()
        found = self._leased_found.get(object_id)
        if found is None or object_id in self._doomed or not self._leases.is_leased(object_id):
            # a second lease (a lookup's, then the load's) shares what the first fetched
            found = self._take_found(object_id)
            if found is None:
                found = await self._get_manifest_and_head(client, object_id)
        self._remember(object_id, found is not None)
        if found is None:
            raise NotFound(f"object {object_id.hex()} is not in redis")
        self._leased[object_id] = found.manifest.meta
        self._leased_found[object_id] = found
        return self._leases.grant(found.manifest.meta, owner, found, ttl)

    async def _get_manifest_and_head(self, client, oid: bytes) -> _Leased | None:
        """The manifest and the first ``PREFETCH_BYTES`` of chunk 0, in one round trip (with
        a budget, the LRU touch too)."""
        commands = [("GET", self._keys.manifest(oid)),
                    ("GETRANGE", self._keys.chunk(oid, 0), 0, PREFETCH_BYTES - 1)]
        with self._edge.call("prepare_load"):
            replies = await self._exchange_touching(client, oid, commands)
            _raise_first_error(replies)
        raw, head = replies
        if raw is None:
            return None
        return _Leased(await self._decode_manifest(client, oid, raw), head, self._capacity is not None)

    async def _exchange_touching(self, client, oid: bytes, commands: list) -> list:
        """``exchange`` of ``commands`` and, with a budget, the object's LRU touch (whose
        reply updates the accounting and is not returned)."""
        if self._capacity is None:  # LRU order only matters to eviction
            return await exchange(client, commands)
        touch = ["touch", oid.hex(), 0, self._ttl or 0]
        replies = await exchange(client, [*commands, self._scripts.command("accounting", self._accounting_keys, touch)])
        _, used, count = await self._scripts.result_of(replies.pop(), "accounting", self._accounting_keys, touch)
        self._bytes_used, self._objects = int(used), int(count)
        return replies

    def leases_in_memory(self, object_id: bytes) -> bool:
        """A lease shares a held lease's manifest, or takes the one a lookup just fetched."""
        if object_id in self._doomed:
            return False
        if object_id in self._leased_found and self._leases.is_leased(object_id):
            return True
        found = self._found.get(object_id)
        return found is not None and time.monotonic() - found[1] < FOUND_FRESH_S

    def _take_found(self, oid: bytes) -> _Leased | None:
        """The manifest ``find_by_keys`` fetched, if fresh (each serves one lease)."""
        found = self._found.pop(oid, None)
        if found is None or oid in self._doomed:
            return None
        manifest, when = found
        return _Leased(manifest) if time.monotonic() - when < FOUND_FRESH_S else None

    async def read(self, lease: Lease) -> memoryview:
        lease = self._leases.check(lease)
        found = lease.location
        blob = await self._fetch(self.client, found.manifest, "read", found.head, touch=not found.touched)
        if blob is None:
            raise NotFound(f"object {lease.object_id.hex()} expired while leased")
        return blob

    async def complete_load(self, lease: Lease) -> None:
        self._leases.release(lease)
        await self._settle_leases()

    async def release_owner(self, owner: object) -> int:
        released = self._leases.release_owner(owner)
        await self._settle_leases()
        return released

    async def _fetch(self, client, manifest: Manifest, op: str, head: bytes | None = None,
                     touch: bool = False) -> memoryview | None:
        """The verified sealed bytes, or ``None`` (cleaned up) when chunks have expired.
        ``head``: the first bytes of chunk 0 fetched before (used when they are all of it).
        ``touch``: the object's LRU entry is touched in the same round trip (with a budget)."""
        oid = manifest.meta.object_id
        if manifest.is_encrypted and self._cipher is None:
            raise CorruptPayload(f"object {oid.hex()} is encrypted at rest; this tier has no cipher")
        held = [head] if head is not None and len(head) == _first_chunk_len(manifest) else []
        commands = [("GET", key) for key in self._keys.chunks(oid, manifest.chunks)[len(held):]]
        if commands or (touch and self._capacity is not None):
            with self._edge.call(op):
                parts = await self._get_chunks(client, oid, commands, touch)
                _raise_first_error(parts)
        else:
            parts = []
        parts = held + parts
        if any(part is None for part in parts):
            await self._try_erase(client, oid, manifest, manifest.chunks)
            return None
        try:
            if manifest.stored_size <= INLINE_BYTES:
                return self._open(parts, manifest)
            return await self._run(self._open, parts, manifest)
        except RejectedState:
            self._corrupt_dropped += 1
            await self._try_erase(client, oid, manifest, manifest.chunks)
            raise

    async def _get_chunks(self, client, oid: bytes, commands: list, touch: bool) -> list:
        """The replies to the chunk GETs, in order. Several chunks travel over up to
        ``FETCH_CONNECTIONS`` connections at once, in contiguous groups (one server writes
        to several sockets faster than to one); a group that fails cancels the others (a
        cancelled exchange closes its connection) and its error is raised: nothing of a
        half-read object is returned."""
        size = -(-len(commands) // min(FETCH_CONNECTIONS, max(1, len(commands))))
        groups = [commands[i : i + size] for i in range(0, len(commands), size)] or [[]]
        calls = [self._exchange_touching(client, oid, groups[0]) if touch else exchange(client, groups[0])]
        calls += [exchange(client, group) for group in groups[1:]]
        return [reply for replies in await _all_or_none(calls) for reply in replies]

    def _open(self, parts: list[bytes], manifest: Manifest) -> memoryview:
        """Reassemble, decrypt, check integrity (in the executor when large).

        Integrity only: framing against the header's own lengths, signature, payload digest.
        Whether the object is the one stored under this id is the reader's judgement
        (``protocol.classify``): an intact object of another identity is no damage here.
        """
        stored = join_chunks(parts)
        blob = self._cipher.open_envelope(stored) if manifest.is_encrypted else stored
        self._verified.open(blob, manifest.meta.object_id)
        return memoryview(blob)

    # -- delete, lookup ----------------------------------------------------------------

    async def delete(self, object_id: bytes) -> bool:
        client = self.client
        with self._edge.call("delete"):
            raw = await client.get(self._keys.manifest(object_id))
        self._remember(object_id, False)
        if raw is None:
            return False
        manifest = Manifest.try_decode(raw)
        if manifest is not None and self._leases.is_leased(object_id):
            with self._edge.call("delete"):
                await client.delete(self._keys.manifest(object_id))
                await client.hdel(self._keys.key_index(manifest.meta.key_digest), object_id.hex())
            self._doomed[object_id] = manifest
            return True
        await self._erase(client, object_id, manifest, manifest.chunks if manifest else None)
        return True

    async def contains(self, object_id: bytes) -> bool:
        with self._edge.call("contains"):
            found = bool(await self.client.exists(self._keys.manifest(object_id)))
        self._remember(object_id, found)
        return found

    async def get_meta(self, object_id: bytes) -> ObjectMeta | None:
        with self._edge.call("get_meta"):
            raw = await self.client.get(self._keys.manifest(object_id))
        manifest = Manifest.try_decode(raw)
        self._remember(object_id, raw is not None)
        return _stored_under(manifest, object_id).meta if manifest else None

    async def find_by_key(self, key_digest: bytes) -> list[ObjectMeta]:
        return (await self.find_by_keys([key_digest])).metas[0]

    async def find_by_keys(self, key_digests: Sequence[bytes],
                           registry: VersionRegistry | None = None) -> KeyMatches:
        """Round trip 1: every key index. Round trip 2: every manifest they name, and the
        heads of their streams when ``registry`` lives on this server. Entries whose
        manifest is gone (expired, evicted, deleted by another node) are pruned after."""
        client = self.client
        indexes = [self._keys.key_index(digest) for digest in key_digests]
        with self._edge.call("find_by_key"):
            replies = await exchange(client, [("HGETALL", index) for index in indexes]) if indexes else []
            _raise_first_error(replies)
        listed = [_index_entries(reply) for reply in replies]
        riding = registry if isinstance(registry, RedisVersionRegistry) and registry.lives_on(self._url, client) \
            else None
        streams = list(dict.fromkeys(s for entries in listed for _, s in entries if s is not None)) if riding else []
        oids = [oid for entries in listed for oid, _ in entries]
        raws, heads = await self._manifests_and_heads(client, oids, riding, streams)
        manifests = iter(_stored_under(Manifest.try_decode(raw), oid) for oid, raw in zip(oids, raws))
        metas, gone, now = [], [], time.monotonic()
        for index, entries in zip(indexes, listed):
            found = []
            for oid, _ in entries:
                manifest = next(manifests)
                if manifest is None:
                    gone.append(("HDEL", index, oid.hex()))
                    continue
                found.append(manifest.meta)
                self._keep_found(oid, manifest, now)
            metas.append(sorted(found, key=lambda m: m.version))
        if gone:  # their objects expired or were evicted: prune lazily
            with self._edge.call("find_by_key"):
                await exchange(client, gone)
        return KeyMatches(metas, heads)

    async def _manifests_and_heads(self, client, oids: list[bytes], registry, streams: list[bytes]) -> tuple:
        """(raw manifest or None per id, {stream: head}) in one round trip."""
        if not oids:
            return [], {}
        asked = registry.head_commands(streams) if streams else []
        with self._edge.call("find_by_key"):
            replies = await exchange(client, [*(("GET", self._keys.manifest(oid)) for oid in oids), *asked])
            _raise_first_error(replies[: len(oids)])
        heads = dict(zip(streams, registry.heads_from(replies[len(oids):]))) if streams else {}
        return replies[: len(oids)], heads

    def _keep_found(self, oid: bytes, manifest: Manifest, now: float) -> None:
        self._found[oid] = (manifest, now)
        self._found.move_to_end(oid)
        if len(self._found) > _FOUND_KEPT:
            self._found.popitem(last=False)

    async def iter_objects(self) -> AsyncIterator[ObjectMeta]:
        client, seen = self.client, set()
        scan = client.scan_iter(match=self._keys.manifest_pattern(), count=512)
        while True:
            with self._edge.call("iter_objects"):
                batch = [key async for key in _take(scan, 256)]
                keys = [key for key in batch if key not in seen]  # SCAN may repeat a key
                raws = await self._get_all(client, keys)
            seen.update(keys)
            for key, raw in zip(keys, raws):
                manifest = _stored_under(Manifest.try_decode(raw), self._keys.object_id_of(key))
                if manifest is not None:
                    yield manifest.meta
            if len(batch) < 256:
                return

    # -- eviction ----------------------------------------------------------------------

    async def evict(self, need_bytes: int = 0) -> list[EvictedObject]:
        if self._capacity is None:
            return []
        client = self.client
        await self._expire_leases()
        await self._account("status")
        if self._bytes_used + need_bytes <= self._high * self._capacity:
            return []
        evicted: list[EvictedObject] = []
        offset, seen = 0, set()
        lru = self._accounting_keys[0]
        while self._bytes_used + need_bytes > self._low * self._capacity:
            with self._edge.call("evict"):
                batch = await client.zrange(lru, offset, offset + _EVICT_BATCH - 1)
            if not batch:
                break
            for raw_id in batch:
                if self._bytes_used + need_bytes <= self._low * self._capacity:
                    break
                oid = bytes.fromhex(raw_id.decode())
                taken = False if oid in seen or self._is_pinned(oid) else await self._take_victim(client, oid)
                seen.add(oid)
                if taken is False:
                    offset += 1  # left in place (pinned, or unreadable here): step over it
                elif taken is not None:
                    evicted.append(taken)
        self._evictions += len(evicted)
        return evicted

    def _is_pinned(self, oid: bytes) -> bool:
        return self._leases.is_leased(oid) or oid in self._storing or oid in self._doomed

    async def _take_victim(self, client, oid: bytes) -> EvictedObject | bool | None:
        """Evict one object: the object, ``None`` (gone or dropped), or ``False`` (kept)."""
        try:
            manifest = await self._get_manifest(client, oid, "evict")
        except CorruptPayload:
            return None
        if manifest is None:  # expired or evicted by Redis itself: only its accounting was left
            self._stale_pruned += await self._account("remove", oid)
            return None
        if manifest.is_encrypted and self._cipher is None:
            return False
        try:
            blob = await self._fetch(client, manifest, "evict")
        except RejectedState:
            return None
        if blob is None:
            return None
        if self._is_pinned(oid) or not await self._account("remove", oid):
            return False if self._is_pinned(oid) else None  # leased meanwhile, or another node won
        await self._erase(client, oid, manifest, manifest.chunks)
        return EvictedObject(manifest.meta, blob)

    # -- stats -------------------------------------------------------------------------

    def stats(self) -> TierStats:
        return TierStats(
            tier=self.name, objects=self._objects, bytes_used=self._bytes_used,
            capacity=self._capacity or 0, leases=len(self._leases),
            inflight=len(self._stores) + len(self._leases), evictions=self._evictions,
            extra={
                "available": self._edge.is_available,
                "unavailable_total": self._edge.unavailable_total,
                "corrupt_dropped": self._corrupt_dropped,
                "stale_pruned": self._stale_pruned,
                "reserved_bytes": self._reserved,
                "cluster": bool(self.is_cluster),
            },
        )

    # -- helpers -----------------------------------------------------------------------

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _account(self, op: str, object_id: bytes = b"", size: int = 0) -> int:
        keys, args = self._accounting_keys, [op, object_id.hex(), size, self._ttl or 0]
        with self._edge.call(f"accounting {op}"):
            (reply,) = await exchange(self.client, [self._scripts.command("accounting", keys, args)])
            changed, used, count = await self._scripts.result_of(reply, "accounting", keys, args)
        self._bytes_used, self._objects = int(used), int(count)
        return int(changed)

    async def _get_manifest(self, client, oid: bytes, op: str) -> Manifest | None:
        """The object's manifest; one that cannot be parsed drops the object."""
        with self._edge.call(op):
            raw = await client.get(self._keys.manifest(oid))
        return None if raw is None else await self._decode_manifest(client, oid, raw)

    async def _decode_manifest(self, client, oid: bytes, raw: bytes) -> Manifest:
        try:
            return _stored_under(decode_manifest(raw), oid)
        except CorruptPayload:
            self._corrupt_dropped += 1
            await self._try_erase(client, oid, None, None)
            raise

    async def _get_all(self, client, keys: list) -> list:
        if not keys:
            return []
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
            return await pipe.execute()

    async def _erase(self, client, oid: bytes, manifest: Manifest | None, chunks: int | None) -> None:
        """Remove every key of an object: manifest first, so no reader sees it half gone.

        ``chunks=None`` (the manifest was unreadable) deletes chunk keys batch by batch
        until one is missing: chunks are numbered from 0 without gaps.
        """
        first, count = 0, _PROBE_BATCH if chunks is None else chunks
        with self._edge.call("delete"):
            async with client.pipeline(transaction=False) as pipe:
                pipe.delete(self._keys.manifest(oid))
                for index in range(count):
                    pipe.delete(self._keys.chunk(oid, index))
                deleted = (await pipe.execute())[1:]
            while chunks is None and deleted and all(deleted):
                first += count
                async with client.pipeline(transaction=False) as pipe:
                    for index in range(first, first + count):
                        pipe.delete(self._keys.chunk(oid, index))
                    deleted = await pipe.execute()
            if manifest is not None:
                await client.hdel(self._keys.key_index(manifest.meta.key_digest), oid.hex())
        self._remember(oid, False)
        await self._account("remove", oid)

    def _remember(self, oid: bytes, stored: bool) -> None:
        """Keep what this node last saw of an object (for ``prepare_store``), a bounded set."""
        if not stored:
            self._known.pop(oid, None)
            self._found.pop(oid, None)
            return
        self._known[oid] = None
        self._known.move_to_end(oid)
        if len(self._known) > _KNOWN_IDS:
            self._known.popitem(last=False)

    async def _try_erase(self, client, oid: bytes, manifest: Manifest | None, chunks: int | None) -> None:
        """Best-effort cleanup: what is left behind expires with its TTL or is pruned later."""
        try:
            await self._erase(client, oid, manifest, chunks)
        except StatetierError:
            pass

    async def _expire_leases(self) -> None:
        if self._leases.expire():
            await self._settle_leases()

    async def _settle_leases(self) -> None:
        """Forget objects no longer leased; delete the chunks of those deleted under a lease."""
        for oid in [oid for oid in self._leased if not self._leases.is_leased(oid)]:
            del self._leased[oid]
            self._leased_found.pop(oid, None)
        for oid in [oid for oid in self._doomed if not self._leases.is_leased(oid)]:
            manifest = self._doomed.pop(oid)
            if self._client is not None:
                await self._try_erase(self._client, oid, manifest, manifest.chunks)


def _stored_under(manifest: Manifest | None, oid: bytes) -> Manifest | None:
    """The manifest as a description of what is stored under ``oid``: a manifest naming
    another object (a writer that mixed up keys) still describes *these* keys; what the
    object really is, is for the reader to judge from the bytes."""
    if manifest is None or manifest.meta.object_id == oid:
        return manifest
    return dataclasses.replace(manifest, meta=dataclasses.replace(manifest.meta, object_id=oid))


async def _all_or_none(calls: list) -> list:
    """The results of the awaitables, run concurrently; the first failure cancels the rest
    and is raised as itself."""
    if len(calls) == 1:
        return [await calls[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0]  # noqa: B904 - the group only wraps it
    return [task.result() for task in tasks]


def _first_chunk_len(manifest: Manifest) -> int:
    """The length of chunk 0 (``plan_chunks``: the header and ``chunk_bytes`` of the rest)."""
    return min(manifest.stored_size, manifest.meta.header_len + manifest.chunk_bytes)


def _index_entries(reply) -> list[tuple[bytes, bytes | None]]:
    """(object id, stream id or None) of each entry of a key index (HGETALL's reply, flat
    or as a dict). An entry's value is ``version:stream hex`` (``index_value``), or the
    version alone (entries written before the stream id was kept)."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2])
    out = []
    for field_, value in pairs:
        _, _, stream = bytes(value).partition(b":")
        out.append((bytes.fromhex(bytes(field_).decode()), bytes.fromhex(stream.decode()) if stream else None))
    return out


def index_value(meta: ObjectMeta) -> str:
    """The key index entry of an object: its version and stream id."""
    return f"{meta.version}:{meta.stream_id.hex()}"


def _sets(keys: list[str], pieces: Sequence) -> list[tuple]:
    return [("SET", key, piece, "EX", PENDING_CHUNK_TTL) for key, piece in zip(keys, pieces)]


def _raise_first_error(replies: list) -> None:
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply


async def _take(iterator: AsyncIterator, count: int) -> AsyncIterator:
    for _ in range(count):
        try:
            yield await iterator.__anext__()
        except StopAsyncIteration:
            return
