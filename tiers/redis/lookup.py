"""What ``RedisTier`` holds, asked without a lease: ``find_by_keys`` in two round trips.

- ``RedisLookup(medium)`` — ``contains`` / ``get_meta`` / ``find_by_keys`` /
  ``iter_objects`` of ``RedisTier`` (``tiers.redis.tier``). The daemon's lookup calls
  ``find_by_keys`` for a whole request; ``iter_objects`` serves listing and recovery.

``find_by_keys``: round trip 1 is the HGETALLs of the key indexes and of the cluster's purge
marks (``KeyMatches.purge_marks``: the daemon honours a new one before it serves what it
located), round trip 2 the GETs of every manifest they name with the stream heads of the
registry (when it lives on this server). Manifests found are kept (``medium.seen.found``)
``loads.FOUND_FRESH_S`` for the lease that follows; index entries whose manifest is gone are
pruned (one more round trip, only then).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Sequence, cast

from redis.asyncio import Redis, RedisCluster

from ..base import KeyMatches, ObjectMeta
from ..registry import StreamHead, VersionRegistry
from ..tolerant_registry import TolerantRegistry
from . import connect
from .connect import raise_first_error
from .layout import Manifest, stored_under
from .medium import RedisMedium
from .registry import RedisVersionRegistry


class RedisLookup:
    """See the module docstring."""

    def __init__(self, medium: RedisMedium) -> None:
        self._medium = medium
        self._keys = medium.keys
        self._edge = medium.edge

    async def contains(self, object_id: bytes) -> bool:
        async with self._edge.call("contains"):
            found = bool(await self._medium.client.exists(self._keys.manifest(object_id)))
        self._medium.seen.remember(object_id, found)
        return found

    async def get_meta(self, object_id: bytes) -> ObjectMeta | None:
        async with self._edge.call("get_meta"):
            raw = cast("bytes | None", await self._medium.client.get(self._keys.manifest(object_id)))
        manifest = stored_under(Manifest.try_decode(raw), object_id)
        self._medium.seen.remember(object_id, raw is not None)
        return manifest.meta if manifest else None

    async def find_by_keys(self, key_digests: Sequence[bytes],
                           registry: VersionRegistry | None = None) -> KeyMatches:
        """Round trip 1: every key index. Round trip 2: every manifest they name, and the
        heads of their streams when ``registry`` lives on this server. Entries whose
        manifest is gone (expired, evicted, deleted by another node) are pruned after."""
        client = self._medium.client
        indexes = [self._keys.key_index(digest) for digest in key_digests]
        asked = [*(("HGETALL", index) for index in indexes), ("HGETALL", self._keys.purges())] if indexes else []
        async with self._edge.call("find_by_key"):
            replies = await connect.exchange(client, asked) if asked else []
            raise_first_error(replies)
        marks = _purge_marks(replies.pop()) if replies else None
        listed = [_index_entries(reply) for reply in replies]
        shared = registry.shared if isinstance(registry, TolerantRegistry) else registry
        riding = shared if isinstance(shared, RedisVersionRegistry) \
            and shared.lives_on(self._medium.options.url, client) else None
        streams = list(dict.fromkeys(s for entries in listed for _, s in entries if s is not None)) if riding else []
        oids = [oid for entries in listed for oid, _ in entries]
        raws, heads = await self._manifests_and_heads(client, oids, riding, streams)
        manifests = iter(stored_under(Manifest.try_decode(raw), oid) for oid, raw in zip(oids, raws))
        metas: list[list[ObjectMeta]] = []
        gone: list[tuple[Any, ...]] = []
        now = time.monotonic()
        for index, entries in zip(indexes, listed):
            found = []
            for oid, _ in entries:
                manifest = next(manifests)
                if manifest is None:
                    gone.append(("HDEL", index, oid.hex()))
                    continue
                found.append(manifest.meta)
                self._medium.seen.found.put(oid, (manifest, now))
            metas.append(sorted(found, key=lambda m: m.version))
        if gone:  # their objects expired or were evicted: prune lazily
            async with self._edge.call("find_by_key"):
                await connect.exchange(client, gone)
        return KeyMatches(metas, heads, marks)

    async def _manifests_and_heads(self, client: Redis | RedisCluster, oids: list[bytes],
                                   registry: RedisVersionRegistry | None, streams: list[bytes]
                                   ) -> tuple[list[Any], dict[bytes, StreamHead | None]]:
        """(raw manifest or None per id, {stream: head}) in one round trip."""
        if not oids:
            return [], {}
        asked = registry.head_commands(streams) if registry is not None and streams else []
        async with self._edge.call("find_by_key"):
            replies = await connect.exchange(client, [*(("GET", self._keys.manifest(oid)) for oid in oids), *asked])
            raise_first_error(replies[: len(oids)])
        heads = dict(zip(streams, registry.heads_from(replies[len(oids):]))) if registry is not None and streams else {}
        return replies[: len(oids)], heads

    async def iter_objects(self) -> AsyncIterator[ObjectMeta]:
        client, seen = self._medium.client, set()
        scan = client.scan_iter(match=self._keys.manifest_pattern(), count=512)
        while True:
            async with self._edge.call("iter_objects"):
                batch = [key async for key in _take(scan, 256)]
                keys = [key for key in batch if key not in seen]  # SCAN may repeat a key
                raws = await self._get_all(client, keys)
            seen.update(keys)
            for key, raw in zip(keys, raws):
                manifest = stored_under(Manifest.try_decode(raw), self._keys.object_id_of(key))
                if manifest is not None:
                    yield manifest.meta
            if len(batch) < 256:
                return

    async def _get_all(self, client: Redis | RedisCluster, keys: list[Any]) -> list[Any]:
        if not keys:
            return []
        async with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.get(key)
            return await pipe.execute()


def _purge_marks(reply: Any) -> dict[str, int]:
    """scope → cutoff of the purge marks' hash (HGETALL's reply, flat or as a dict)."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2])
    return {bytes(scope).decode(): int(cutoff) for scope, cutoff in pairs}


def _index_entries(reply: Any) -> list[tuple[bytes, bytes | None]]:
    """(object id, stream id or None) of each entry of a key index (HGETALL's reply, flat
    or as a dict). An entry's value is ``version:stream hex`` (``index_value``), or the
    version alone (entries written before the stream id was kept)."""
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2])
    out: list[tuple[bytes, bytes | None]] = []
    for field_, value in pairs:
        _, _, stream = bytes(value).partition(b":")
        out.append((bytes.fromhex(bytes(field_).decode()), bytes.fromhex(stream.decode()) if stream else None))
    return out



async def _take(iterator: AsyncIterator[Any], count: int) -> AsyncIterator[Any]:
    for _ in range(count):
        try:
            yield await iterator.__anext__()
        except StopAsyncIteration:
            return
