"""``PeerTier``: objects other daemons of the cluster hold, found through the directory and
pulled straight from their owner; and this daemon's published objects, described there.

- ``find_by_keys`` — one directory round trip for all the keys: the objects other live
  owners hold (this daemon's own entries and fenced owners left out).
- ``prepare_load`` → ``read(lease, into=…, verify=…)`` → ``complete_load`` — a lease (released,
  or past its TTL on ``options.clock``: ``LeaseError``, as every tier's), the bytes
  pulled from the owner with the ``PeerTransport`` into ``into`` (a promotion's
  reservation in this daemon's arena) or a fresh buffer; framing and signature checked
  here, the payload digest too with ``verify`` (the load path's client verifies where the
  bytes land). A pull that fails within its deadline (the transport redialled and retried
  already) is ``PeerLost`` and the load goes on to the next copy; its owner is fenced here
  (its entries no longer offered by this daemon) only on evidence its process is gone, and
  offered again once it renews its liveness key (``tiers.peer.liveness``). No puller
  withdraws another owner's entries. A daemon restarted on the same address is a new owner id.
- ``prepare_store`` → ``write`` → ``complete_store`` — the publish of an object this
  daemon holds (``holds_locally``): its descriptor (header, size, this owner) into the
  directory, its bytes staying where they are, and recorded here: published again when the
  directory comes back empty. A peer tier never takes bytes it does not hold locally (a
  demotion into it is ``CapacityError``: it goes further down).
- ``contains`` / ``get_meta`` — a copy another owner holds. Nothing to evict or compact.
Serving this daemon's objects to the others is ``tiers.peer.serve.PeerServer``, started here,
with the liveness key's renewal. ``faults`` (``tiers.peer.faults``) counts every fault met.
"""

from __future__ import annotations

import itertools
import asyncio
from typing import AsyncIterator, Awaitable, Callable, Sequence

from statetier.protocol.errors import CapacityError, NotFound, PeerLost, StatetierError
from statetier.protocol.identity import NAMESPACE_BYTES
from statetier.protocol.keyring import Keyring
from statetier.protocol.lru import BoundedLru
from statetier.protocol.ownership import TAG_BYTES
from statetier.protocol.sealed import open_sealed
from statetier.tiers.base import (Buffer, EvictedObject, KeyMatches, Lease, ObjectMeta, StoreTicket, Tier,
                                  TierStats)
from statetier.tiers.ledger import LeaseTable
from statetier.tiers.registry import VersionRegistry

from . import wire
from .directory import Descriptor, Directory
from .faults import PeerFaults
from .liveness import Liveness, OwnerAnnouncer, OwnerFences
from .options import PeerTierOptions
from .serve import PeerServer
from .transport import Landed, PeerTransport, PullItem, TcpTransport

SEEN = 65536  # descriptors a lookup brought, each serving the lease that follows


class PeerTier(Tier):
    name = "peer"
    holds_bytes = False

    def __init__(self, options: PeerTierOptions, *, keyring: Keyring, local_tiers: Sequence[Tier],
                 holds_locally: Callable[[bytes], Awaitable[bool]],
                 transport: PeerTransport | None = None) -> None:
        self.options = options
        self._keyring = keyring
        self._holds_locally = holds_locally
        self.directory = Directory(options.redis_url, options.ttl_seconds)
        self.server = PeerServer(keyring, options, local_tiers)
        self.transport: PeerTransport = transport or TcpTransport(keyring, options)
        self.faults: PeerFaults = self.transport.faults  # the transport's redials and retries, the tier's fences
        # liveness on a connection of its own: never queued behind a lookup, apart in the counts
        self.liveness_directory = Directory(options.redis_url, options.ttl_seconds)
        self.fences = OwnerFences(self.liveness_directory, self.transport, self.faults)
        self.announcer = OwnerAnnouncer(self.liveness_directory, options, self.faults, holds_locally)
        self.liveness = Liveness(self.announcer, self.fences, options.liveness_ttl / 3)
        self._seen: BoundedLru[bytes, Descriptor] = BoundedLru(SEEN)
        self._leases = LeaseTable(options.lease_ttl, options.clock)
        self._ids = itertools.count(1)
        self.pulls_lost = 0
        self.published = 0

    async def start(self) -> None:
        wire.auth_key(self._keyring.active)  # an Ed25519 or keyless keyring: ConfigError before listening
        await self.server.start()
        await self.directory.start()
        await self.transport.start(self.server)  # NIXL: its agent, its metadata, the listener's EXPOSE
        await self.liveness_directory.start()
        await self.liveness.start()

    async def close(self) -> None:
        await self.liveness.close()
        await self.server.close()
        await self.transport.close()
        await self.directory.close()
        await self.liveness_directory.close()

    # ---------------------------------------------------------------- publish
    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket:
        if not await self._holds_locally(meta.object_id):
            raise CapacityError("a peer tier describes objects this daemon holds; it takes no bytes")
        return StoreTicket(meta, next(self._ids))

    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None:
        header = bytearray()
        for chunk in chunks:
            header += memoryview(chunk).cast("B")[: ticket.meta.header_len - len(header)]
            if len(header) >= ticket.meta.header_len:
                break
        ticket.location = bytes(header)
        ticket.written = ticket.meta.size

    async def complete_store(self, ticket: StoreTicket, success: bool) -> None:
        if not success or not isinstance(ticket.location, bytes):
            return
        descriptor = Descriptor(self.options.owner_id, self.server.address, ticket.meta, ticket.location)
        await self.directory.publish(descriptor)
        self.announcer.record(descriptor)
        self.published += 1
        self.server.published()  # its pulls are likely next: the write-behind waits for them

    # ---------------------------------------------------------------- lookups
    def _offered(self, descriptor: Descriptor | None) -> bool:
        return descriptor is not None and descriptor.owner != self.options.owner_id \
            and not self.fences.is_fenced(descriptor.owner)

    async def find_by_keys(self, key_digests: Sequence[bytes],
                           registry: VersionRegistry | None = None) -> KeyMatches:
        found = await self.directory.find(key_digests)
        metas: list[list[ObjectMeta]] = []
        for descriptors in found:
            offered = [d for d in descriptors if self._offered(d)]
            for d in offered:
                self._seen.put(d.meta.object_id, d)
            metas.append(sorted((d.meta for d in offered), key=lambda m: (m.version, m.created_at_ns)))
        return KeyMatches(metas)

    async def _descriptor(self, object_id: bytes) -> Descriptor | None:
        descriptor = self._seen.get(object_id) or await self.directory.get(object_id)
        return descriptor if self._offered(descriptor) else None

    async def contains(self, object_id: bytes) -> bool:
        return await self._descriptor(object_id) is not None

    async def get_meta(self, object_id: bytes) -> ObjectMeta | None:
        descriptor = await self._descriptor(object_id)
        return None if descriptor is None else descriptor.meta

    # ---------------------------------------------------------------- loads
    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease:
        descriptor = await self._descriptor(object_id)
        if descriptor is None:
            raise NotFound(f"no live peer holds {object_id.hex()}")
        return self._leases.grant(descriptor.meta, owner, descriptor, ttl)

    async def read(self, lease: Lease, *, into: memoryview | None = None, verify: bool = True) -> memoryview:
        descriptor = self._leases.check(lease).location  # a released or expired lease: LeaseError
        assert isinstance(descriptor, Descriptor)
        meta = descriptor.meta
        view = into if into is not None else memoryview(bytearray(meta.size))
        try:
            await self.transport.pull(descriptor.address, meta.object_id,
                                      meta.namespace[NAMESPACE_BYTES - TAG_BYTES:], view)
        except PeerLost as exc:
            await self._lost(descriptor, exc)
            raise
        except NotFound:
            await self._not_there(descriptor)
            raise
        open_sealed(view, None, self._keyring, verify_payload=verify)
        return view

    async def pull_many(self, pulls: Sequence[tuple[Lease, memoryview]], landed: Landed) -> None:
        by_owner: dict[str, list[int]] = {}
        for index, (lease, _) in enumerate(pulls):
            descriptor = lease.location
            assert isinstance(descriptor, Descriptor)  # a lease of this tier
            by_owner.setdefault(descriptor.address, []).append(index)
        await asyncio.gather(*(self._pull_from(address, [(i, *pulls[i]) for i in indices], landed)
                               for address, indices in by_owner.items()))

    async def _pull_from(self, address: str, pulls: list[tuple[int, Lease, memoryview]], landed: Landed) -> None:
        """One owner's share of ``pull_many``: each object checked where it landed; a lost
        owner judged (``_lost``: fenced on evidence only) and what it no longer holds
        (``_not_there``) once the batch is told."""
        lost: tuple[Descriptor, PeerLost] | None = None
        gone: list[Descriptor] = []

        def check(at: int, error: StatetierError | None) -> None:
            nonlocal lost
            index, lease, view = pulls[at]
            descriptor = lease.location
            assert isinstance(descriptor, Descriptor)
            if error is None:
                try:
                    open_sealed(view, None, self._keyring, verify_payload=False)
                except StatetierError as exc:
                    error = exc
            elif isinstance(error, PeerLost):
                lost = lost or (descriptor, error)
            elif isinstance(error, NotFound):
                self._seen.pop(descriptor.meta.object_id)
                gone.append(descriptor)
            landed(index, error)

        items = [PullItem(lease.meta.object_id, lease.meta.namespace[NAMESPACE_BYTES - TAG_BYTES:], view)
                 for _, lease, view in pulls]
        await self.transport.pull_many(address, items, check)
        if lost is not None:
            await self._lost(*lost)
        for descriptor in gone[:1]:  # one judgement of the owner at that address suffices
            await self._not_there(descriptor)

    async def _lost(self, descriptor: Descriptor, exc: PeerLost) -> None:
        """A pull from ``descriptor``'s owner failed within its deadline: fenced on evidence only."""
        self.pulls_lost += 1
        self._seen.pop(descriptor.meta.object_id)
        await self.fences.judge_lost(descriptor, exc)

    async def _not_there(self, descriptor: Descriptor) -> None:
        """The owner at ``descriptor``'s address does not hold it (it may be another process now)."""
        self._seen.pop(descriptor.meta.object_id)
        await self.fences.judge_not_found(descriptor)

    async def complete_load(self, lease: Lease) -> None:
        self._leases.release(lease)

    async def release_owner(self, owner: object) -> int:
        return self._leases.release_owner(owner)

    # ---------------------------------------------------------------- the rest of the interface
    async def delete(self, object_id: bytes) -> bool:
        descriptor = await self.directory.get(object_id)
        if descriptor is None or descriptor.owner != self.options.owner_id:
            return False
        await self.directory.withdraw(object_id, descriptor.meta.key_digest)
        self.announcer.discard(object_id)
        return True

    async def iter_objects(self) -> AsyncIterator[ObjectMeta]:
        return
        yield  # an async generator of nothing: a peer tier lists none of its own

    async def evict(self, need_bytes: int = 0) -> list[EvictedObject]:
        return []

    def stats(self) -> TierStats:
        server = self.server
        return TierStats("peer", 0, 0, 0, len(self._leases), 0, extra={
            "address": server.address,  # what the other daemons dial: `statetier stats`, the start banner
            "published": self.published, "pulls": self.transport.pulls,
            "bytes_pulled": self.transport.bytes_pulled, "served": server.served,
            "bytes_served": server.bytes_served,
            "refused": server.refused, "handshakes_failed": server.handshakes_failed,
            "pull_batches_answered": server.batches, "pull_requests_answered": server.requests,
            "pulls_lost": self.pulls_lost, "owners_fenced": len(self.fences),
            "directory_commands": self.directory.commands, "faults": self.faults.snapshot(),
            **self.transport.stats()})
