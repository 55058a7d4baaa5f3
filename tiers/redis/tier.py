"""The Redis tier: sealed objects in Redis or Redis Cluster, shared by every node.

``RedisTier`` is the ``Tier`` of DESIGN §5, composed of the parts of one path each; this
module holds its state (all declared in ``__init__``), its lifecycle, ``stats`` and the
accounting and manifest reads every part uses:

- ``tiers.redis.store`` — ``StorePath``: pending chunks, then the manifest-last commit.
- ``tiers.redis.load`` — ``LoadPath``: leases, prefetch, parallel chunk read, verification.
- ``tiers.redis.lookup`` — ``Lookup``: ``find_by_keys`` in two round trips, ``iter_objects``.
- ``tiers.redis.evict`` — ``Removal``: ``delete``, LRU ``evict``, the manifest-first erase.

Every hot-path round trip is one ``connect.exchange``. Leases are local to this instance.
``stats()``: objects and bytes_used of the whole prefix (all nodes) as of the last
accounting call; capacity 0 = no budget; ``extra["available"]`` = the last call reached
Redis. A failure to reach Redis is ``Unavailable``, wrong credentials ``Unauthorized``.
Public beyond ``Tier``: ``client`` (for a ``RedisVersionRegistry`` sharing the connection),
``is_cluster``, ``is_available``, ``key_prefix``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections import OrderedDict

from redis.asyncio import Redis, RedisCluster

from statetier.protocol.errors import ConfigError, CorruptPayload
from statetier.protocol.keyring import Keyring
from ..base import LeaseTable, ObjectMeta, StoreTicket, Tier, TierStats
from ..crypto import AtRestCipher
from . import connect
from .connect import open_client
from .errors import RedisEdge
from .evict import Removal
from .layout import CHUNK_BYTES, Manifest, RedisKeys, decode_manifest, stored_under
from .load import LoadPath, Leased
from .lookup import Lookup
from .scripts import Scripts
from .store import StorePath
from .verify import VerifiedHeaders

_KNOWN_IDS = 1 << 16  # object ids remembered as stored, for prepare_store's refusal


class RedisTier(StorePath, LoadPath, Lookup, Removal, Tier):
    """The Redis tier (see the module docstring); its state is all declared here."""

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
        self._leased_found: dict[bytes, Leased] = {}  # their manifests, shared by leases
        self._found: OrderedDict[bytes, tuple[Manifest, float]] = OrderedDict()  # by find_by_keys, when
        self._doomed: dict[bytes, Manifest] = {}  # deleted while leased: chunks go at the last release
        self._stores: dict[int, StoreTicket] = {}
        self._storing: set[bytes] = set()
        self._ticket_ids = itertools.count(1)
        self._known: OrderedDict[bytes, None] = OrderedDict()  # seen stored (most recent last)
        self._reserved = 0
        self._objects = self._bytes_used = 0  # as Redis reported on the last accounting call
        self._evictions = self._corrupt_dropped = self._stale_pruned = 0

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
        client = self._client
        if client is not None:
            for ticket in list(self._stores.values()):
                self._stores.pop(ticket.ticket_id, None)
                await self._try_drop_pending(client, ticket.meta.object_id, ticket.location)
            self._storing.clear()
            self._reserved = 0
            for oid, manifest in list(self._doomed.items()):  # our leases end with us
                await self._try_erase(client, oid, manifest, manifest.chunks)  # its accounting needs the client
            self._doomed.clear()
            self._client = None
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

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _account(self, op: str, object_id: bytes = b"", size: int = 0) -> int:
        keys, args = self._accounting_keys, [op, object_id.hex(), size, self._ttl or 0]
        with self._edge.call(f"accounting {op}"):
            (reply,) = await connect.exchange(self.client, [self._scripts.command("accounting", keys, args)])
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
            return stored_under(decode_manifest(raw), oid)
        except CorruptPayload:
            self._corrupt_dropped += 1
            await self._try_erase(client, oid, None, None)
            raise

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
