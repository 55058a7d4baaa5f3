"""The load path of ``RedisTier``: leases, the prefetch, the parallel chunk read, verification.

- ``LoadPath`` — ``prepare_load`` / ``read`` / ``complete_load`` / ``release_owner`` and
  ``leases_in_memory`` of ``RedisTier`` (one of the parts ``tiers.redis.tier`` composes; the
  state it uses is declared in ``RedisTier.__init__``), called by the daemon's loads; its
  ``_fetch`` also serves ``evict``.
- ``FOUND_FRESH_S``, ``PREFETCH_BYTES``, ``FETCH_CONNECTIONS`` — what a lease takes from a
  lookup, how much of chunk 0 rides with the manifest, how many connections one read uses.

A lease takes the manifest a ``find_by_keys`` fetched less than ``FOUND_FRESH_S`` ago, or
fetches it with the first ``PREFETCH_BYTES`` of chunk 0 in one round trip. ``read`` fetches
the rest in one round trip over up to ``FETCH_CONNECTIONS`` connections, reassembles,
decrypts and checks integrity (``tiers.redis.verify``); a damaged object is deleted, one
signed under a key id this node's keyring lacks (``UnknownKey``) is refused and left.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from statetier.protocol.classify import is_damage
from statetier.protocol.errors import CorruptPayload, NotFound, RejectedState
from ..base import Lease
from . import connect
from .connect import raise_first_error
from .layout import INLINE_BYTES, Manifest, join_chunks

# A manifest find_by_keys fetched serves one prepare_load for this long: the lookup that
# found it leases it at once. A lease trusts its manifest for its whole TTL anyway (leases
# are local; a read whose chunks are gone is NotFound), so this adds no new staleness.
FOUND_FRESH_S = 1.0
FETCH_CONNECTIONS = 4  # the chunks of one object are read over this many connections at once
PREFETCH_BYTES = 128 << 10  # of chunk 0, fetched by a lease that did not come from a lookup


@dataclass(frozen=True, slots=True)
class Leased:
    manifest: Manifest
    head: bytes | None = None  # the first bytes of chunk 0, fetched with the manifest
    touched: bool = False  # the LRU touch rode with the manifest: the read need not touch


class LoadPath:
    """``RedisTier``'s load methods (see the module docstring)."""

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

    async def _get_manifest_and_head(self, client, oid: bytes) -> Leased | None:
        """The manifest and the first ``PREFETCH_BYTES`` of chunk 0, in one round trip (with
        a budget, the LRU touch too)."""
        commands = [("GET", self._keys.manifest(oid)),
                    ("GETRANGE", self._keys.chunk(oid, 0), 0, PREFETCH_BYTES - 1)]
        with self._edge.call("prepare_load"):
            replies = await self._exchange_touching(client, oid, commands)
            raise_first_error(replies)
        raw, head = replies
        if raw is None:
            return None
        return Leased(await self._decode_manifest(client, oid, raw), head, self._capacity is not None)

    async def _exchange_touching(self, client, oid: bytes, commands: list) -> list:
        """``exchange`` of ``commands`` and, with a budget, the object's LRU touch (whose
        reply updates the accounting and is not returned)."""
        if self._capacity is None:  # LRU order only matters to eviction
            return await connect.exchange(client, commands)
        touch = ["touch", oid.hex(), 0, self._ttl or 0]
        replies = await connect.exchange(client, [*commands, self._scripts.command("accounting", self._accounting_keys, touch)])
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

    def _take_found(self, oid: bytes) -> Leased | None:
        """The manifest ``find_by_keys`` fetched, if fresh (each serves one lease)."""
        found = self._found.pop(oid, None)
        if found is None or oid in self._doomed:
            return None
        manifest, when = found
        return Leased(manifest) if time.monotonic() - when < FOUND_FRESH_S else None

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
                raise_first_error(parts)
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
        except RejectedState as exc:
            if is_damage(exc):  # an unknown key id is another keyring's object: left for the nodes holding it
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
        calls = [self._exchange_touching(client, oid, groups[0]) if touch else connect.exchange(client, groups[0])]
        calls += [connect.exchange(client, group) for group in groups[1:]]
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
