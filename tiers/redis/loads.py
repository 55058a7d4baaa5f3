"""The load path of ``RedisTier``: leases, the prefetch, the parallel chunk read, verification.

- ``RedisLoads(ledger, medium, removal)`` — ``prepare_load`` / ``read`` (with ``into``: a
  promotion's chunks copied straight into its arena reservation, no joined buffer; with
  ``verify=False``: no pass over the payload) / ``complete_load`` / ``release_owner``
  and ``leases_in_memory`` of ``RedisTier`` (``tiers.redis.tier``),
  called by the daemon's loads; ``fetch`` also serves eviction, ``expire_leases`` /
  ``settle`` end what leases held (the chunks of objects deleted under a lease go then).
- ``FOUND_FRESH_S``, ``PREFETCH_BYTES``, ``FETCH_CONNECTIONS`` — what a lease takes from a
  lookup, how much of chunk 0 rides with the manifest, how many connections one read uses.

A lease takes the manifest a ``find_by_keys`` fetched less than ``FOUND_FRESH_S`` ago, or
fetches it with the first ``PREFETCH_BYTES`` of chunk 0 in one round trip. ``read`` fetches
the rest in one round trip over up to ``FETCH_CONNECTIONS`` connections, reassembles,
decrypts and checks integrity (``protocol.classify.open_intact``, with a ``VerifiedHeaders``
so a header read again is not verified again); a damaged object is deleted, one signed
under a key id this node's keyring lacks (``UnknownKey``) is refused and left.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from redis.asyncio import Redis, RedisCluster

from statetier.protocol.cancellation import wait_out_cancellation
from statetier.protocol.classify import is_damage, open_intact
from statetier.protocol.errors import CorruptPayload, InvalidRequest, NotFound, RejectedState
from statetier.protocol.passes import PASSES, copy_into
from statetier.protocol.sealed import VerifiedHeaders

from ..base import Lease
from ..ledger import Ledger
from . import connect
from .connect import raise_first_error
from .layout import INLINE_BYTES, Manifest, join_chunks
from .medium import RedisMedium
from .removal import RedisRemoval

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


class RedisLoads:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[Manifest], medium: RedisMedium, removal: RedisRemoval) -> None:
        self._ledger = ledger
        self._medium = medium
        self._removal = removal
        self._leased: dict[bytes, Leased] = {}  # manifests of objects under a lease, shared by their leases
        self._verified = VerifiedHeaders(2048)

    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease:
        client = self._medium.client
        await self.expire_leases()
        found = self._leased.get(object_id)
        if found is None or self._ledger.is_hidden(object_id) or not self._ledger.leases.is_leased(object_id):
            # a second lease (a lookup's, then the load's) shares what the first fetched
            found = self._take_found(object_id)
            if found is None:
                found = await self._get_manifest_and_head(client, object_id)
        self._medium.seen.remember(object_id, found is not None)
        if found is None:
            raise NotFound(f"object {object_id.hex()} is not in redis")
        self._leased[object_id] = found
        return self._ledger.leases.grant(found.manifest.meta, owner, found, ttl)

    async def _get_manifest_and_head(self, client: Redis | RedisCluster, oid: bytes) -> Leased | None:
        """The manifest and the first ``PREFETCH_BYTES`` of chunk 0, in one round trip (with
        a budget, the LRU touch too)."""
        keys = self._medium.keys
        commands = [("GET", keys.manifest(oid)), ("GETRANGE", keys.chunk(oid, 0), 0, PREFETCH_BYTES - 1)]
        async with self._medium.edge.call("prepare_load"):
            replies = await self._medium.exchange_touching(oid, commands)
            raise_first_error(replies)
        raw, head = replies
        if raw is None:
            return None
        manifest = await self._removal.decode_manifest(client, oid, raw)
        return Leased(manifest, head, self._medium.options.capacity_bytes is not None)

    def leases_in_memory(self, object_id: bytes) -> bool:
        """A lease shares a held lease's manifest, or takes the one a lookup just fetched."""
        if self._ledger.is_hidden(object_id):
            return False
        if object_id in self._leased and self._ledger.leases.is_leased(object_id):
            return True
        found = self._medium.seen.found.peek(object_id)
        return found is not None and time.monotonic() - found[1] < FOUND_FRESH_S

    def _take_found(self, oid: bytes) -> Leased | None:
        """The manifest ``find_by_keys`` fetched, if fresh (each serves one lease)."""
        found = self._medium.seen.found.pop(oid)
        if found is None or self._ledger.is_hidden(oid):
            return None
        manifest, when = found
        return Leased(manifest) if time.monotonic() - when < FOUND_FRESH_S else None

    async def read(self, lease: Lease, *, into: memoryview | None = None, verify: bool = True) -> memoryview:
        """The object, its integrity checked (the payload digest only when ``verify``); with
        ``into`` (the object's exact size) each chunk copied into place as it came, no joined
        buffer, returning only once no thread writes there any more, even when cancelled."""
        if into is None:
            return await self._read(lease, verify_payload=verify)
        await self._read_into(lease, into, verify_payload=verify)
        return into

    async def _read(self, lease: Lease, *, verify_payload: bool) -> memoryview:
        found = self._found_for(lease)
        blob = await self.fetch(self._medium.client, found.manifest, "read", found.head, touch=not found.touched,
                                verify_payload=verify_payload)
        if blob is None:
            raise NotFound(f"object {lease.object_id.hex()} expired while leased")
        return blob

    async def _read_into(self, lease: Lease, dest: memoryview, *, verify_payload: bool) -> None:
        found, client = self._found_for(lease), self._medium.client
        manifest = found.manifest
        if dest.nbytes != manifest.meta.size:
            raise InvalidRequest(f"a {dest.nbytes}-byte destination for a {manifest.meta.size}-byte object")
        parts = await self._fetch_parts(client, manifest, "read", found.head, touch=not found.touched)
        if parts is None:
            raise NotFound(f"object {lease.object_id.hex()} expired while leased")
        await self._judged(client, manifest, self._open_into, parts, manifest, dest, verify_payload)

    def _found_for(self, lease: Lease) -> Leased:
        found = self._ledger.leases.check(lease).location
        assert isinstance(found, Leased)
        return found

    async def complete_load(self, lease: Lease) -> None:
        self._ledger.leases.release(lease)
        await self.settle()

    async def release_owner(self, owner: object) -> int:
        released = self._ledger.leases.release_owner(owner)
        await self.settle()
        return released

    async def expire_leases(self) -> None:
        if self._ledger.leases.expire():
            await self.settle()

    async def settle(self) -> None:
        """Forget objects no longer leased; delete the chunks of those deleted under a lease."""
        leases = self._ledger.leases
        for oid in [oid for oid in self._leased if not leases.is_leased(oid)]:
            del self._leased[oid]
        for _, manifest in self._ledger.reap_all():
            if self._medium.is_started:
                await self._removal.try_erase(self._medium.client, manifest.meta.object_id, manifest,
                                              manifest.chunks)

    async def fetch(self, client: Redis | RedisCluster, manifest: Manifest, op: str, head: bytes | None = None,
                    touch: bool = False, verify_payload: bool = True) -> memoryview | None:
        """The verified sealed bytes, or ``None`` (cleaned up) when chunks have expired.
        ``head``: the first bytes of chunk 0 fetched before (used when they are all of it).
        ``touch``: the object's LRU entry is touched in the same round trip (with a budget).
        ``verify_payload=False``: framing and signature only (``read(verify=False)``)."""
        parts = await self._fetch_parts(client, manifest, op, head, touch)
        if parts is None:
            return None
        opened: memoryview = await self._judged(client, manifest, self._open, parts, manifest, verify_payload)
        return opened

    async def _fetch_parts(self, client: Redis | RedisCluster, manifest: Manifest, op: str, head: bytes | None,
                           touch: bool) -> list[bytes] | None:
        """The stored chunks, in order, or ``None`` (cleaned up) when chunks have expired."""
        medium = self._medium
        oid = manifest.meta.object_id
        if manifest.is_encrypted and medium.cipher is None:
            raise CorruptPayload(f"object {oid.hex()} is encrypted at rest; this tier has no cipher")
        held = [head] if head is not None and len(head) == _first_chunk_len(manifest) else []
        commands = [("GET", key) for key in medium.keys.chunks(oid, manifest.chunks)[len(held):]]
        if commands or (touch and medium.options.capacity_bytes is not None):
            async with medium.edge.call(op):
                parts = await self._get_chunks(client, oid, commands, touch)
                raise_first_error(parts)
        else:
            parts = []
        parts = held + parts
        if any(part is None for part in parts):
            await self._removal.try_erase(client, oid, manifest, manifest.chunks)
            return None
        return parts

    async def _judged(self, client: Redis | RedisCluster, manifest: Manifest, check: Callable[..., Any],
                      *args: Any) -> Any:
        """``check(*args)`` — on the loop for a small object, else in the executor, waited out
        even when cancelled (it may write into a caller's buffer); damage drops the object."""
        try:
            if manifest.stored_size <= INLINE_BYTES:
                return check(*args)
            return await wait_out_cancellation(asyncio.ensure_future(self._medium.run(check, *args)))
        except RejectedState as exc:
            if is_damage(exc):  # an unknown key id is another keyring's object: left for the nodes holding it
                self._ledger.corrupt_dropped += 1
                oid = manifest.meta.object_id
                await self._removal.try_erase(client, oid, manifest, manifest.chunks)
            raise

    async def _get_chunks(self, client: Redis | RedisCluster, oid: bytes, commands: list[tuple[Any, ...]],
                          touch: bool) -> list[Any]:
        """The replies to the chunk GETs, in order. Several chunks travel over up to
        ``FETCH_CONNECTIONS`` connections at once, in contiguous groups (one server writes
        to several sockets faster than to one); a group that fails cancels the others (a
        cancelled exchange closes its connection) and its error is raised: nothing of a
        half-read object is returned."""
        size = -(-len(commands) // min(FETCH_CONNECTIONS, max(1, len(commands))))
        groups = [commands[i : i + size] for i in range(0, len(commands), size)] or [[]]
        first = self._medium.exchange_touching(oid, groups[0]) if touch else connect.exchange(client, groups[0])
        calls = [first, *(connect.exchange(client, group) for group in groups[1:])]
        return [reply for replies in await _all_or_none(calls) for reply in replies]

    def _open(self, parts: list[bytes], manifest: Manifest, verify_payload: bool = True) -> memoryview:
        """Reassemble, decrypt, check integrity (in the executor when large).

        Integrity only: framing against the header's own lengths, signature, payload digest.
        Whether the object is the one stored under this id is the reader's judgement
        (``protocol.classify``): an intact object of another identity is no damage here.
        """
        stored = join_chunks(parts)
        cipher = self._medium.cipher
        blob = cipher.open_envelope(stored) if manifest.is_encrypted and cipher is not None else stored
        open_intact(blob, self._medium.keyring, verify_payload=verify_payload, verified=self._verified)
        return memoryview(blob)

    def _open_into(self, parts: list[bytes], manifest: Manifest, dest: memoryview, verify_payload: bool) -> None:
        """``_open`` into ``dest``: a plain object's chunks copied into place one by one (no
        joined buffer); an envelope opened, then copied. Checked there."""
        if manifest.is_encrypted:
            blob = self._open(parts, manifest, verify_payload)
            if blob.nbytes != dest.nbytes:
                raise InvalidRequest(f"a {dest.nbytes}-byte destination for a {blob.nbytes}-byte object")
            copy_into(dest, blob)
            return
        stored = sum(len(part) for part in parts)
        if stored != dest.nbytes:  # not what the manifest says: damage, or another object's bytes
            self._open(parts, manifest, verify_payload)  # raises what the bytes say of themselves
            raise InvalidRequest(f"a {dest.nbytes}-byte destination for a {stored}-byte object")
        at = 0
        for part in parts:
            dest[at : at + len(part)] = part
            at += len(part)
        PASSES.count_copied(at)
        open_intact(dest, self._medium.keyring, verify_payload=verify_payload, verified=self._verified)


async def _all_or_none(calls: list[Coroutine[Any, Any, list[Any]]]) -> list[list[Any]]:
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
