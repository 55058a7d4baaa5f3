"""The Redis tier: sealed objects in Redis or Redis Cluster, shared by every node.

``RedisTier(RedisTierOptions(url, …), *, keyring, cipher=None, executor=None)`` is the
``Tier`` of DESIGN §5. Its medium is a ``RedisMedium`` (``tiers.redis.medium``: the client
and every call through it, the seam of every part); its bookkeeping one ``Ledger``
(``tiers.ledger``); as a ``ComposedTier`` (``tiers.composed``) each call goes to the part
of one path:

- ``tiers.redis.stores`` — ``RedisStores``: pending chunks, then the manifest-last commit.
- ``tiers.redis.loads`` — ``RedisLoads``: leases, prefetch, parallel chunk read, verification.
- ``tiers.redis.lookup`` — ``RedisLookup``: ``find_by_keys`` in two round trips, ``iter_objects``.
- ``tiers.redis.removal`` — ``RedisRemoval``: ``delete`` and the manifest-first erase.
- ``tiers.redis.evict`` — ``RedisEviction``: LRU ``evict`` under a byte budget.

Every hot-path round trip is one ``connect.exchange``. Leases are local to this instance.
``stats()``: objects and bytes_used of the whole prefix (all nodes) as of the last
accounting call; capacity 0 = no budget; ``extra["available"]`` = the last call reached
Redis. A failure to reach Redis is ``Unavailable``, wrong credentials ``Unauthorized``.
Public beyond ``Tier``: ``client`` (for a ``RedisVersionRegistry`` sharing the connection),
``edge`` (to share with it), ``mark_purge``/``purge_marks`` (cluster-wide purges: it
declares ``tiers.base.PurgeMarkStore``), ``probe()`` (one bounded health check, which marks
the edge up or down: while down every call fails at once), ``is_cluster``, ``is_available``,
``key_prefix``. Every call is held to ``options.socket_timeout``, retries included.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Coroutine
from typing import Any, AsyncIterator, Sequence

from redis.asyncio import Redis, RedisCluster

from statetier.protocol.errors import StatetierError
from statetier.protocol.keyring import Keyring

from ..base import KeyMatches, ObjectMeta, PurgeMarkStore, StoreTicket, TierStats
from ..composed import ComposedTier
from ..crypto import AtRestCipher
from ..ledger import Ledger
from ..registry import VersionRegistry
from .errors import RedisEdge
from .evict import RedisEviction
from .layout import Manifest
from .loads import RedisLoads
from .lookup import RedisLookup
from .medium import RedisMedium
from .options import RedisTierOptions
from .removal import RedisRemoval
from .stores import RedisStores


class RedisTier(ComposedTier, PurgeMarkStore):
    """See the module docstring."""

    verifies_on_read = True  # read() checks every object's signature and payload digest (RedisLoads)

    def __init__(self, options: RedisTierOptions, *, keyring: Keyring, cipher: AtRestCipher | None = None,
                 executor: concurrent.futures.Executor | None = None) -> None:
        self.options = options
        self.key_prefix = options.key_prefix
        self._ledger: Ledger[Manifest] = Ledger(options.name, options.lease_ttl, options.clock)
        self._medium = RedisMedium(options, keyring, cipher, executor)
        self._removal = RedisRemoval(self._ledger, self._medium)
        self._stores = RedisStores(self._ledger, self._medium, self._removal)
        self._loads = RedisLoads(self._ledger, self._medium, self._removal)
        self._lookup = RedisLookup(self._medium)
        self._eviction = RedisEviction(self._ledger, self._medium, self._removal, self._loads)
        super().__init__(options.name, self._stores, self._loads, self._removal, self._eviction)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self._medium.start()

    async def close(self) -> None:
        client = self._medium.take_client()
        if client is not None:
            await self._stores.close_all(client)
            for meta, manifest in list(self._ledger.hidden.values()):  # our leases end with us
                await self._removal.try_erase(client, meta.object_id, manifest, manifest.chunks)
            self._ledger.forget_all()
        await self._medium.close(client)

    @property
    def client(self) -> Redis | RedisCluster:
        return self._medium.client

    @property
    def is_cluster(self) -> bool | None:
        return self._medium.is_cluster

    @property
    def is_available(self) -> bool:
        return self._medium.edge.is_available

    @property
    def edge(self) -> RedisEdge:
        """The error edge of every call (share it with a ``RedisVersionRegistry`` on the
        same server, so the health probe speaks for both)."""
        return self._medium.edge

    async def mark_purge(self, scope: str, cutoff_ns: int) -> None:
        """Record a cluster-wide purge: every object of ``scope`` ("ns:<namespace hex>" or
        "tenant:<name>") created up to ``cutoff_ns`` is gone, on every daemon sharing Redis."""
        medium = self._medium
        async with medium.edge.call("purge mark"):
            await medium.client.hset(medium.keys.purges(), scope, str(cutoff_ns))

    async def purge_marks(self) -> dict[str, int]:
        """Every purge mark: scope → cutoff (ns since the epoch); one round trip."""
        medium = self._medium
        async with medium.edge.call("purge marks"):
            raw = await medium.client.hgetall(medium.keys.purges())
        return {_text(scope): int(cutoff) for scope, cutoff in raw.items()}

    def probe(self) -> Coroutine[Any, Any, bool]:
        """One bounded health check; the edge is marked up or down (``RedisMedium.probe``)."""
        return self._medium.probe()

    # ------------------------------------------------------------------ beyond ComposedTier

    def leases_in_memory(self, object_id: bytes) -> bool:
        return self._loads.leases_in_memory(object_id)

    def complete_stores(self, tickets: Sequence[StoreTicket]) -> Coroutine[Any, Any, list[StatetierError | None]]:
        return self._stores.complete_stores(tickets)

    def contains(self, object_id: bytes) -> Coroutine[Any, Any, bool]:
        return self._lookup.contains(object_id)

    def get_meta(self, object_id: bytes) -> Coroutine[Any, Any, ObjectMeta | None]:
        return self._lookup.get_meta(object_id)

    def find_by_keys(self, key_digests: Sequence[bytes],
                     registry: VersionRegistry | None = None) -> Coroutine[Any, Any, KeyMatches]:
        return self._lookup.find_by_keys(key_digests, registry)

    def iter_objects(self) -> AsyncIterator[ObjectMeta]:
        return self._lookup.iter_objects()

    def stats(self) -> TierStats:
        medium, ledger = self._medium, self._ledger
        return TierStats(
            tier=self.name, objects=medium.objects, bytes_used=medium.bytes_used,
            capacity=self.options.capacity_bytes or 0, leases=len(ledger.leases),
            inflight=len(ledger.stores) + len(ledger.leases), evictions=ledger.evictions,
            extra={
                "available": medium.edge.is_available and not medium.edge.is_down,
                "refused_while_down": medium.edge.refused_while_down,
                "unavailable_total": medium.edge.unavailable_total,
                "corrupt_dropped": ledger.corrupt_dropped,
                "stale_pruned": self._eviction.stale_pruned,
                "reserved_bytes": ledger.reserved_bytes,
                "cluster": bool(medium.is_cluster),
            },
        )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
