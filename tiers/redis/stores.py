"""The store path of ``RedisTier``: pending chunks, then the manifest-last commit.

- ``RedisStores(ledger, medium, removal)`` — ``prepare_store`` / ``write`` /
  ``complete_store`` of ``RedisTier`` (``tiers.redis.tier``); ``close_all`` drops what the
  stores still open sent. The daemon's placement calls them, in that order, per object;
  ``complete_stores(tickets)`` commits a batch at once (one script call on one server).
- ``index_value(meta)`` — the key index entry of an object (version and stream id).

Chunks go to pending keys named after the store; an object of one chunk travels with the
commit (one round trip in all). The Lua commit renames the pending chunks and writes the
manifest last, only if none exists and every chunk is there; on a single server it also
updates the key index and the accounting, on a cluster one more round trip does. A failed
or cancelled store deletes its pending chunks (``_try_drop_pending``, ``_try_roll_back``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

from redis.asyncio import Redis, RedisCluster

from statetier.protocol.errors import CapacityError, InternalError, InvalidRequest, StatetierError

from ..base import Buffer, ObjectMeta, StoreTicket
from ..ledger import Ledger
from . import connect
from .connect import raise_first_error
from .layout import INLINE_BYTES, PENDING_CHUNK_TTL, Manifest, plan_chunks
from .medium import RedisMedium
from .removal import RedisRemoval


@dataclass(slots=True)
class _PendingChunks:
    store_id: str  # names its pending chunk keys and goes into the manifest
    chunks: int = 0  # pending chunk keys this store may have written (what cleanup deletes)
    stored_size: int = 0
    staged: list[Any] | None = None  # the chunk values that go with the commit (not sent by write)


class RedisStores:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[Manifest], medium: RedisMedium, removal: RedisRemoval) -> None:
        self._ledger = ledger
        self._medium = medium
        self._removal = removal
        self._keys = medium.keys
        self._edge = medium.edge
        self._options = medium.options
        self._checking: set[bytes] = set()  # ids whose prepare_store is asking Redis

    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket:
        client, ledger, capacity = self._medium.client, self._ledger, self._options.capacity_bytes
        oid = meta.object_id
        if ledger.is_storing(oid) or oid in self._checking or ledger.is_hidden(oid):
            raise InvalidRequest(f"object {oid.hex()} is already being stored or deleted")
        unevictable = ledger.reserved_bytes + ledger.leases.leased_bytes()
        if capacity is not None and meta.size + unevictable > capacity:
            raise CapacityError(f"{meta.size} bytes do not fit in the {ledger.name} tier: {unevictable} of "
                                f"{capacity} bytes are reserved or leased", tier=ledger.name, need=meta.size)
        if oid in self._medium.seen.known:  # seen stored: confirm, another node may have deleted it since
            self._checking.add(oid)
            try:
                async with self._edge.call("prepare_store"):
                    (exists,) = await connect.exchange(client, [("EXISTS", self._keys.manifest(oid))])
                    raise_first_error([exists])
            finally:
                self._checking.discard(oid)
            if exists:
                raise InvalidRequest(f"object {oid.hex()} is already stored")
            self._medium.seen.known.discard(oid)
        return ledger.open_store(meta, _PendingChunks(os.urandom(6).hex()))

    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None:
        client, pending = self._medium.client, self._pending(ticket)
        if pending.chunks or ticket.written:
            raise InvalidRequest("write() was already called for this ticket")
        size = sum(memoryview(c).nbytes for c in chunks)
        if size != ticket.meta.size:
            raise InvalidRequest(f"write got {size} bytes; the object is {ticket.meta.size}")
        head, cipher = ticket.meta.header_len, self._medium.cipher
        if cipher is not None:  # the envelope is ours: it waits for the commit
            envelope = (cipher.seal_envelope(b"".join(chunks)) if size <= INLINE_BYTES
                        else await self._medium.run(lambda: cipher.seal_envelope(b"".join(chunks))))
            pieces = pending.staged = plan_chunks([envelope], self._options.chunk_bytes, head)
            size = len(envelope)
        else:
            pieces = plan_chunks(chunks, self._options.chunk_bytes, head)
            if len(pieces) == 1:  # goes with the commit; the caller keeps its buffers until then
                pending.staged = pieces
        pending.chunks, pending.stored_size = len(pieces), size
        if pending.staged is None:
            oid = ticket.meta.object_id
            try:
                async with self._edge.call("write"):
                    raise_first_error(await connect.exchange(client, _sets(self._pending_keys(oid, pending), pieces)))
            except StatetierError:
                await self._try_drop_pending(client, oid, pending)
                raise
        ticket.written = ticket.meta.size

    async def complete_store(self, ticket: StoreTicket, success: bool) -> None:
        if not self._ledger.close_store(ticket):
            return  # completed before (or never ours): nothing is held
        meta, pending = ticket.meta, ticket.location
        assert isinstance(pending, _PendingChunks)
        client = self._medium.client
        if not success or ticket.written != meta.size:
            await self._try_drop_pending(client, meta.object_id, pending)
            if success:
                raise InvalidRequest("complete_store(success=True) before the object was written")
            return
        manifest = Manifest(meta, pending.stored_size, pending.chunks, self._options.chunk_bytes,
                            self._medium.cipher is not None, pending.store_id)
        try:
            committed = await self._commit(client, manifest, pending)
        except BaseException:
            await self._try_roll_back(client, manifest, pending)
            raise
        refused = self._refusal(meta, committed)
        if refused is not None:
            raise refused

    async def complete_stores(self, tickets: Sequence[StoreTicket]) -> list[StatetierError | None]:
        """``complete_store(ticket, True)`` of each ticket, committed together: the chunks
        that go with the commits and one commit script call for the whole batch in one round
        trip (on a cluster, whose objects live in other slots, the commits in one pipeline
        and the index and accounting in one more). In order, ``None`` for each object stored
        and the error of each refused; an error reaching Redis is raised for them all."""
        client = self._medium.client
        out: list[StatetierError | None] = [None] * len(tickets)
        batch: list[tuple[int, Manifest, _PendingChunks]] = []
        for index, ticket in enumerate(tickets):
            if not self._ledger.close_store(ticket):
                continue  # completed before (or never ours): nothing is held
            pending = ticket.location
            assert isinstance(pending, _PendingChunks)
            if ticket.written != ticket.meta.size:
                await self._try_drop_pending(client, ticket.meta.object_id, pending)
                out[index] = InvalidRequest("complete_store(success=True) before the object was written")
                continue
            batch.append((index, Manifest(ticket.meta, pending.stored_size, pending.chunks, self._options.chunk_bytes,
                                          self._medium.cipher is not None, pending.store_id), pending))
        if not batch:
            return out
        try:
            statuses = await self._commit_batch(client, [(manifest, pending) for _, manifest, pending in batch])
        except BaseException:
            for _, manifest, pending in batch:
                await self._try_roll_back(client, manifest, pending)
            raise
        for (index, manifest, _), committed in zip(batch, statuses):
            out[index] = self._refusal(manifest.meta, committed)
        return out

    def _refusal(self, meta: ObjectMeta, committed: int) -> StatetierError | None:
        """What a commit's status says: None (stored), or why the object was not."""
        if committed == 0:
            return InternalError(f"chunks of {meta.object_id.hex()} vanished before the commit "
                                 "(redis maxmemory eviction?)")
        self._medium.seen.remember(meta.object_id, True)
        if committed == -1:  # another node stored this state_id meanwhile: its object stands
            return InvalidRequest(f"object {meta.object_id.hex()} is already stored")
        return None

    async def _commit(self, client: Redis | RedisCluster, manifest: Manifest, pending: _PendingChunks) -> int:
        """Send the staged chunks (if any) and the commit; 1, 0 (a chunk is gone) or -1 (exists)."""
        meta, oid = manifest.meta, manifest.meta.object_id
        pending_keys = self._pending_keys(oid, pending)
        moves = [*pending_keys, *self._keys.chunks(oid, pending.chunks)]
        ttl, medium = self._options.ttl_seconds or 0, self._medium
        keys: list[str]
        args: list[Any]
        if medium.is_cluster:  # the key index and the accounting live in other slots
            name, keys, args = "commit", [self._keys.manifest(oid), *moves], [manifest.encode(), ttl]
        else:
            name = "commit_indexed"
            keys = [self._keys.manifest(oid), self._keys.key_index(meta.key_digest), *medium.accounting_keys, *moves]
            args = [manifest.encode(), ttl, oid.hex(), meta.size, index_value(meta)]
        sets = [] if pending.staged is None else _sets(pending_keys, pending.staged)
        async with self._edge.call("complete_store"):
            replies = await connect.exchange(client, [*sets, medium.scripts.command(name, keys, args)])
            raise_first_error(replies[:-1])
            reply = await medium.scripts.result_of(replies[-1], name, keys, args)
            committed = int(reply[0])
            if committed == 1 and medium.is_cluster:
                reply = await self._index_and_account(client, meta)
        if committed == 1:
            medium.bytes_used, medium.objects = int(reply[1]), int(reply[2])
        return committed

    async def _commit_batch(self, client: Redis | RedisCluster,
                            batch: list[tuple[Manifest, _PendingChunks]]) -> list[int]:
        """``_commit`` of every object of ``batch`` in one round trip (a cluster: two); their
        statuses, in order."""
        medium, ttl = self._medium, self._options.ttl_seconds or 0
        sets: list[tuple[Any, ...]] = []
        for manifest, pending in batch:
            if pending.staged is not None:
                sets += _sets(self._pending_keys(manifest.meta.object_id, pending), pending.staged)
        if medium.is_cluster:
            return await self._commit_batch_on_cluster(client, batch, sets)
        keys: list[Any] = [*medium.accounting_keys]
        args: list[Any] = [ttl]
        for manifest, pending in batch:
            meta, oid = manifest.meta, manifest.meta.object_id
            keys += [self._keys.manifest(oid), self._keys.key_index(meta.key_digest),
                     *self._pending_keys(oid, pending), *self._keys.chunks(oid, pending.chunks)]
            args += [pending.chunks, manifest.encode(), oid.hex(), meta.size, index_value(meta)]
        name = "commit_batch_indexed"
        async with self._edge.call("complete_store"):
            replies = await connect.exchange(client, [*sets, medium.scripts.command(name, keys, args)])
            raise_first_error(replies[:-1])
            reply = await medium.scripts.result_of(replies[-1], name, keys, args)
        if int(reply[0]):
            medium.bytes_used, medium.objects = int(reply[1]), int(reply[2])
        return [int(status) for status in reply[3:]]

    async def _commit_batch_on_cluster(self, client: Redis | RedisCluster, batch: list[tuple[Manifest, _PendingChunks]],
                                       sets: list[tuple[Any, ...]]) -> list[int]:
        """Each object's commit script in its own slot, all in one pipeline; then the key
        index entries and the accounting of those committed, in one more."""
        ttl, scripts = self._options.ttl_seconds or 0, self._medium.scripts
        calls = []
        for manifest, pending in batch:
            oid = manifest.meta.object_id
            calls.append(([self._keys.manifest(oid), *self._pending_keys(oid, pending),
                           *self._keys.chunks(oid, pending.chunks)], [manifest.encode(), ttl]))
        async with self._edge.call("complete_store"):
            replies = await connect.exchange(client, [*sets, *(scripts.command("commit", k, a) for k, a in calls)])
            raise_first_error(replies[: len(sets)])
            statuses = [int((await scripts.result_of(reply, "commit", k, a))[0])
                        for reply, (k, a) in zip(replies[len(sets):], calls)]
            committed = [manifest.meta for (manifest, _), status in zip(batch, statuses) if status == 1]
            if committed:
                reply = await self._index_and_account_all(client, committed)
                self._medium.bytes_used, self._medium.objects = int(reply[1]), int(reply[2])
        return statuses

    async def _index_and_account(self, client: Redis | RedisCluster, meta: ObjectMeta) -> Any:
        return await self._index_and_account_all(client, [meta])

    async def _index_and_account_all(self, client: Redis | RedisCluster, metas: list[ObjectMeta]) -> Any:
        """Cluster only: the key index entries and the accounting "add" of ``metas``, in one
        round trip; the last accounting reply."""
        ttl, scripts = self._options.ttl_seconds, self._medium.scripts
        keys = self._medium.accounting_keys
        commands: list[tuple[Any, ...]] = []
        accounted: list[list[Any]] = []
        for meta in metas:
            index = self._keys.key_index(meta.key_digest)
            commands.append(("HSET", index, meta.object_id.hex(), index_value(meta)))
            if ttl:
                commands.append(("EXPIRE", index, ttl))
        for meta in metas:
            accounted.append(["add", meta.object_id.hex(), meta.size, ttl or 0])
        replies = await connect.exchange(client, [*commands,
                                                  *(scripts.command("accounting", keys, a) for a in accounted)])
        raise_first_error(replies[: len(commands)])
        reply = None
        for answer, args in zip(replies[len(commands):], accounted):
            reply = await scripts.result_of(answer, "accounting", keys, args)
        return reply

    async def close_all(self, client: Redis | RedisCluster) -> None:
        """Forget the stores still open, deleting what they sent (the tier closes)."""
        for ticket in self._ledger.close_all_stores():
            if isinstance(ticket.location, _PendingChunks):
                await self._try_drop_pending(client, ticket.meta.object_id, ticket.location)

    def _pending(self, ticket: StoreTicket) -> _PendingChunks:
        if not self._ledger.is_open(ticket) or not isinstance(ticket.location, _PendingChunks):
            raise InvalidRequest(f"store ticket {ticket.ticket_id} is not open")
        return ticket.location

    def _pending_keys(self, oid: bytes, pending: _PendingChunks) -> list[str]:
        return self._keys.pending_chunks(oid, pending.store_id, pending.chunks)

    async def _try_drop_pending(self, client: Redis | RedisCluster, oid: bytes, pending: _PendingChunks) -> None:
        """Delete the pending chunks ``write`` sent (best effort: they expire anyway)."""
        if pending.staged is not None or not pending.chunks:
            return  # nothing was sent
        try:
            async with self._edge.call("delete"):
                await client.delete(*self._pending_keys(oid, pending))
        except StatetierError:
            pass

    async def _try_roll_back(self, client: Redis | RedisCluster, manifest: Manifest, pending: _PendingChunks) -> None:
        """After a commit that failed or was cancelled midway: drop the pending chunks and,
        when the commit did land, the object (only if its manifest names this store)."""
        oid = manifest.meta.object_id
        try:
            async with self._edge.call("delete"):
                replies = await connect.exchange(client, [("DEL", *self._pending_keys(oid, pending)),
                                                  ("GET", self._keys.manifest(oid))])
                raise_first_error(replies)
            found = Manifest.try_decode(replies[1])
        except StatetierError:
            return
        if found is not None and found.store_id == manifest.store_id:
            await self._removal.try_erase(client, oid, found, found.chunks)


def index_value(meta: ObjectMeta) -> str:
    """The key index entry of an object: its version and stream id."""
    return f"{meta.version}:{meta.stream_id.hex()}"


def _sets(keys: list[str], pieces: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [("SET", key, piece, "EX", PENDING_CHUNK_TTL) for key, piece in zip(keys, pieces)]
