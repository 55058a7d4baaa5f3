"""How objects leave ``RedisTier``: ``delete``, and the erase every part uses.

- ``RedisRemoval(ledger, medium)`` — ``delete`` of ``RedisTier`` (``tiers.redis.tier``);
  ``erase`` / ``try_erase`` for every part that must drop an object; ``get_manifest`` /
  ``decode_manifest``, which drop an object whose manifest cannot be parsed (counted in
  ``Ledger.corrupt_dropped``).

``delete`` under a lease removes the manifest at once and hides the object
(``Ledger.hide``): its chunks go when the last lease ends (``RedisLoads.settle``).
``erase`` removes the manifest first, so no reader sees an object half gone.
"""

from __future__ import annotations

from typing import cast

from redis.asyncio import Redis, RedisCluster

from statetier.protocol.errors import CorruptPayload, StatetierError

from ..ledger import Ledger
from .layout import Manifest, decode_manifest, stored_under
from .medium import RedisMedium

_PROBE_BATCH = 16  # chunk keys deleted per round trip when the count is unknown


class RedisRemoval:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[Manifest], medium: RedisMedium) -> None:
        self._ledger = ledger
        self._medium = medium

    async def delete(self, object_id: bytes) -> bool:
        medium = self._medium
        client = medium.client
        async with medium.edge.call("delete"):
            raw = cast("bytes | None", await client.get(medium.keys.manifest(object_id)))
        medium.seen.remember(object_id, False)
        if raw is None:
            return False
        manifest = Manifest.try_decode(raw)
        if manifest is not None and self._ledger.leases.is_leased(object_id):
            async with medium.edge.call("delete"):
                await client.delete(medium.keys.manifest(object_id))
                await client.hdel(medium.keys.key_index(manifest.meta.key_digest), object_id.hex())
            self._ledger.hide(manifest.meta, manifest)
            return True
        await self.erase(client, object_id, manifest, manifest.chunks if manifest else None)
        return True

    async def get_manifest(self, client: Redis | RedisCluster, oid: bytes, op: str) -> Manifest | None:
        """The object's manifest; one that cannot be parsed drops the object."""
        async with self._medium.edge.call(op):
            raw = cast("bytes | None", await client.get(self._medium.keys.manifest(oid)))
        return None if raw is None else await self.decode_manifest(client, oid, raw)

    async def decode_manifest(self, client: Redis | RedisCluster, oid: bytes, raw: bytes) -> Manifest:
        try:
            manifest = stored_under(decode_manifest(raw), oid)
        except CorruptPayload:
            self._ledger.corrupt_dropped += 1
            await self.try_erase(client, oid, None, None)
            raise
        assert manifest is not None  # stored_under of a manifest is one, or raises
        return manifest

    async def erase(self, client: Redis | RedisCluster, oid: bytes, manifest: Manifest | None,
                    chunks: int | None) -> None:
        """Remove every key of an object: manifest first, so no reader sees it half gone.

        ``chunks=None`` (the manifest was unreadable) deletes chunk keys batch by batch
        until one is missing: chunks are numbered from 0 without gaps.
        """
        keys = self._medium.keys
        first, count = 0, _PROBE_BATCH if chunks is None else chunks
        async with self._medium.edge.call("delete"):
            async with client.pipeline(transaction=False) as pipe:
                pipe.delete(keys.manifest(oid))
                for index in range(count):
                    pipe.delete(keys.chunk(oid, index))
                deleted = (await pipe.execute())[1:]
            while chunks is None and deleted and all(deleted):
                first += count
                async with client.pipeline(transaction=False) as pipe:
                    for index in range(first, first + count):
                        pipe.delete(keys.chunk(oid, index))
                    deleted = await pipe.execute()
            if manifest is not None:
                await client.hdel(keys.key_index(manifest.meta.key_digest), oid.hex())
        self._medium.seen.remember(oid, False)
        await self._medium.account("remove", oid, client=client)

    async def try_erase(self, client: Redis | RedisCluster, oid: bytes, manifest: Manifest | None,
                        chunks: int | None) -> None:
        """Best-effort cleanup: what is left behind expires with its TTL or is pruned later."""
        try:
            await self.erase(client, oid, manifest, chunks)
        except StatetierError:
            pass
