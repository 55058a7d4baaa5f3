"""How objects leave ``RedisTier``: ``delete``, ``evict`` and the erase both use.

- ``Removal`` — ``delete`` / ``evict`` of ``RedisTier`` (one of the parts
  ``tiers.redis.tier`` composes; the state it uses is declared in ``RedisTier.__init__``),
  called by the daemon's deletes and its capacity loop; ``_erase`` / ``_try_erase`` serve
  every other part that must drop an object.

``delete`` under a lease removes the manifest at once and the chunks at the last release.
``evict`` walks the LRU order shared by every node on the prefix and claims each victim
atomically (the accounting script's "remove"), so two nodes never both take one.
``_erase`` removes the manifest first, so no reader sees an object half gone.
"""

from __future__ import annotations

from statetier.protocol.errors import CorruptPayload, RejectedState, StatetierError, UnknownKey
from ..base import EvictedObject
from .layout import Manifest

_EVICT_BATCH = 32
_PROBE_BATCH = 16  # chunk keys deleted per round trip when the count is unknown


class Removal:
    """``RedisTier``'s delete and eviction methods (see the module docstring)."""

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
        except UnknownKey:
            return False  # another keyring's object: not this node's to judge, so not to drop
        except RejectedState:
            return None
        if blob is None:
            return None
        if self._is_pinned(oid) or not await self._account("remove", oid):
            return False if self._is_pinned(oid) else None  # leased meanwhile, or another node won
        await self._erase(client, oid, manifest, manifest.chunks)
        return EvictedObject(manifest.meta, blob)

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

    async def _try_erase(self, client, oid: bytes, manifest: Manifest | None, chunks: int | None) -> None:
        """Best-effort cleanup: what is left behind expires with its TTL or is pruned later."""
        try:
            await self._erase(client, oid, manifest, chunks)
        except StatetierError:
            pass
