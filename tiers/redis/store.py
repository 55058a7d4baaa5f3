"""The store path of ``RedisTier``: pending chunks, then the manifest-last commit.

- ``StorePath`` — ``prepare_store`` / ``write`` / ``complete_store`` of ``RedisTier`` (one
  of the parts ``tiers.redis.tier`` composes; the state it uses is declared in
  ``RedisTier.__init__``). The daemon's placement calls them, in that order, per object.
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
from typing import Sequence

from statetier.protocol.errors import CapacityError, InternalError, InvalidRequest, StatetierError
from ..base import Buffer, ObjectMeta, StoreTicket
from . import connect
from .connect import raise_first_error
from .layout import INLINE_BYTES, PENDING_CHUNK_TTL, Manifest, plan_chunks


@dataclass(slots=True)
class _PendingStore:
    store_id: str  # names its pending chunk keys and goes into the manifest
    chunks: int = 0  # pending chunk keys this store may have written (what cleanup deletes)
    stored_size: int = 0
    staged: list | None = None  # the chunk values that go with the commit (not sent by write)


class StorePath:
    """``RedisTier``'s store methods (see the module docstring)."""

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
                    (exists,) = await connect.exchange(client, [("EXISTS", self._keys.manifest(oid))])
                    raise_first_error([exists])
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
                    raise_first_error(await connect.exchange(client, _sets(self._pending_keys(oid, pending), pieces)))
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
            replies = await connect.exchange(client, [*sets, self._scripts.command(name, keys, args)])
            raise_first_error(replies[:-1])
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
        replies = await connect.exchange(client, [*commands, self._scripts.command("accounting", keys, args)])
        raise_first_error(replies[:-1])
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
                replies = await connect.exchange(client, [("DEL", *self._pending_keys(oid, pending)),
                                                  ("GET", self._keys.manifest(oid))])
                raise_first_error(replies)
            found = Manifest.try_decode(replies[1])
        except StatetierError:
            return
        if found is not None and found.store_id == manifest.store_id:
            await self._try_erase(client, oid, found, found.chunks)


def index_value(meta: ObjectMeta) -> str:
    """The key index entry of an object: its version and stream id."""
    return f"{meta.version}:{meta.stream_id.hex()}"


def _sets(keys: list[str], pieces: Sequence) -> list[tuple]:
    return [("SET", key, piece, "EX", PENDING_CHUNK_TTL) for key, piece in zip(keys, pieces)]
