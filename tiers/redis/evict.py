"""LRU eviction of ``RedisTier`` under a byte budget, shared by every node on the prefix.

- ``RedisEviction(ledger, medium, removal, loads)`` — ``evict`` of ``RedisTier``
  (``tiers.redis.tier``), called by the daemon's capacity loop; ``stale_pruned`` counts
  accounting entries whose object Redis itself had already dropped.

``evict`` walks the LRU order shared by every node on the prefix and claims each victim
atomically (the accounting script's "remove"), so two nodes never both take one; a victim
leased, being stored or deleted under a lease here is stepped over. Its bytes are read
(``RedisLoads.fetch``, verified) so the caller can demote them.
"""

from __future__ import annotations

from typing import cast

from redis.asyncio import Redis, RedisCluster

from statetier.protocol.errors import CorruptPayload, RejectedState, UnknownKey

from ..base import EvictedObject
from ..ledger import Ledger
from .layout import Manifest
from .loads import RedisLoads
from .medium import RedisMedium
from .removal import RedisRemoval

_EVICT_BATCH = 32


class RedisEviction:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[Manifest], medium: RedisMedium, removal: RedisRemoval,
                 loads: RedisLoads) -> None:
        self._ledger = ledger
        self._medium = medium
        self._removal = removal
        self._loads = loads
        self.stale_pruned = 0

    async def evict(self, need_bytes: int = 0) -> list[EvictedObject]:
        medium = self._medium
        capacity = medium.options.capacity_bytes
        if capacity is None:
            return []
        client = medium.client
        await self._loads.expire_leases()
        await medium.account("status")
        if medium.bytes_used + need_bytes <= medium.options.high_watermark * capacity:
            return []
        low = medium.options.low_watermark * capacity
        evicted: list[EvictedObject] = []
        offset, seen = 0, set[bytes]()
        lru = medium.accounting_keys[0]
        while medium.bytes_used + need_bytes > low:
            async with medium.edge.call("evict"):
                batch = cast("list[bytes]", await client.zrange(lru, offset, offset + _EVICT_BATCH - 1))
            if not batch:
                break
            for raw_id in batch:
                if medium.bytes_used + need_bytes <= low:
                    break
                oid = bytes.fromhex(raw_id.decode())
                taken = False if oid in seen or self._is_pinned(oid) else await self._take_victim(client, oid)
                seen.add(oid)
                if taken is False:
                    offset += 1  # left in place (pinned, or unreadable here): step over it
                elif isinstance(taken, EvictedObject):
                    evicted.append(taken)
        self._ledger.evictions += len(evicted)
        return evicted

    def _is_pinned(self, oid: bytes) -> bool:
        ledger = self._ledger
        return ledger.leases.is_leased(oid) or ledger.is_storing(oid) or ledger.is_hidden(oid)

    async def _take_victim(self, client: Redis | RedisCluster, oid: bytes) -> EvictedObject | bool | None:
        """Evict one object: the object, ``None`` (gone or dropped), or ``False`` (kept)."""
        try:
            manifest = await self._removal.get_manifest(client, oid, "evict")
        except CorruptPayload:
            return None
        if manifest is None:  # expired or evicted by Redis itself: only its accounting was left
            self.stale_pruned += await self._medium.account("remove", oid)
            return None
        if manifest.is_encrypted and self._medium.cipher is None:
            return False
        try:
            blob = await self._loads.fetch(client, manifest, "evict")
        except UnknownKey:
            return False  # another keyring's object: not this node's to judge, so not to drop
        except RejectedState:
            return None
        if blob is None:
            return None
        if self._is_pinned(oid) or not await self._medium.account("remove", oid):
            return False if self._is_pinned(oid) else None  # leased meanwhile, or another node won
        await self._removal.erase(client, oid, manifest, manifest.chunks)
        return EvictedObject(manifest.meta, blob)
