"""The one tier interface, its value objects, and the lease table every tier uses.

A tier stores sealed objects (``header + payload`` bytes, see ``statetier.protocol.sealed``)
under their ``object_id`` (the 16-byte state_id) and indexes them by ``key_digest``
(``StateKey.digest()``). Lifecycle, always paired in ``try/finally``:

    ticket = await tier.prepare_store(meta)         # reserves room, or CapacityError
    await tier.write(ticket, chunks)                # or fill ``ticket.view`` in place
    await tier.complete_store(ticket, success=True) # visible only now; False frees it all

    lease = await tier.prepare_load(object_id, owner=conn_id)   # pins bytes, or NotFound
    data = await tier.read(lease)                   # memoryview valid until complete_load
    await tier.complete_load(lease)                 # unpins

``find_by_keys(digests, registry)`` answers ``find_by_key`` for many keys at once (one
round trip for a tier behind the network); a tier that shares the registry's server may
also bring back the stream heads of what it found (``KeyMatches.heads``), so a whole
request's lookup costs the same few round trips whatever its number of objects.

``evict()`` removes least-recently-used unleased objects until usage is under the low
watermark and returns them *with their bytes*, so the caller can demote rather than drop;
``evict_sparing_copies(need, is_held_below)`` may leave out the bytes of victims a lower
tier already holds.
``compact()`` (disk segments, host arena) never moves or frees bytes under a lease.
Foreign exceptions never leave a tier: each translates them into ``statetier`` errors.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

from statetier.protocol.errors import LeaseError
from statetier.protocol.identity import Kind
from statetier.protocol.sealed import SealedHeader
from statetier.tiers.registry import StreamHead, VersionRegistry

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class KeyMatches:
    """What ``Tier.find_by_keys`` found: per digest, the objects (oldest version first);
    ``heads``: stream id → newest head (None: no head), for the streams the tier could
    ask the registry about on the way (may be empty, never wrong)."""

    metas: list[list["ObjectMeta"]]
    heads: dict[bytes, StreamHead | None] = field(default_factory=dict)


async def _gather_all(calls: list) -> list:
    """The awaitables' results, run concurrently; the first failure is raised after all end."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What a tier knows of an object without reading it (its index entry)."""

    object_id: bytes  # the state_id
    key_digest: bytes  # StateKey.digest()
    stream_id: bytes
    version: int
    kind: Kind
    size: int  # header + payload bytes
    header_len: int
    created_at_ns: int = 0
    request_id: str = ""  # with the key the caller looked up, enough to rebuild the StateRef
    step: int = 0
    speculative: bool = False  # the snapshot holds speculative tokens: never served by key or lookup
    # What ``statetier ls`` and ``purge`` select by, recorded where the object was put; not
    # part of the identity a tier compares (the key digest already binds the namespace):
    namespace: bytes = field(default=b"", compare=False)  # the key's namespace digest (b"": not recorded)
    tenant: str = field(default="", compare=False)  # the tenant whose put stored it ("": not recorded)

    @classmethod
    def from_header(cls, header: SealedHeader) -> "ObjectMeta":
        return cls(
            object_id=header.state_id,
            key_digest=header.key.digest(),
            stream_id=header.stream_id,
            version=header.version,
            kind=header.key.kind,
            size=header.header_len + header.payload_len,
            header_len=header.header_len,
            created_at_ns=header.provenance.created_at_ns,
            request_id=header.provenance.request_id,
            step=header.provenance.step,
            speculative=header.contains_speculative,
            namespace=header.key.namespace.digest,
        )


@dataclass(slots=True)
class StoreTicket:
    """A store in progress. ``view`` is set by tiers that can be written in place (host)."""

    meta: ObjectMeta
    ticket_id: int
    view: memoryview | None = None
    location: object = None  # tier-private (arena offset, segment reservation, …)
    written: int = 0


@dataclass(slots=True)
class Lease:
    """A pin on one object's physical bytes for the duration of one transfer."""

    lease_id: int
    meta: ObjectMeta
    owner: object
    deadline: float  # time.monotonic() seconds
    location: object = None  # tier-private (offset + generation, segment + offset, …)

    @property
    def object_id(self) -> bytes:
        return self.meta.object_id


@dataclass(frozen=True, slots=True)
class EvictedObject:
    """What ``evict`` removed; ``blob`` is None when the object left without its bytes being
    read, because a lower tier already holds a copy (``evict_sparing_copies``)."""

    meta: ObjectMeta
    blob: bytes | bytearray | memoryview | None


@dataclass(frozen=True, slots=True)
class TierStats:
    tier: str
    objects: int
    bytes_used: int
    capacity: int
    leases: int
    inflight: int
    evictions: int = 0
    compactions_run: int = 0
    compactions_blocked: int = 0
    bytes_reclaimed: int = 0
    extra: dict = field(default_factory=dict)


class LeaseTable:
    """Leases of one tier: by id, by object, by owner; with deadlines.

    ``is_leased(object_id)`` is what compaction and eviction consult. Expired leases are
    dropped by ``expire()`` (called from the tier's maintenance and before compaction);
    using an expired or released lease raises ``LeaseError``.
    """

    def __init__(self, default_ttl: float = 30.0) -> None:
        self.default_ttl = default_ttl
        self._ids = itertools.count(1)
        self._leases: dict[int, Lease] = {}
        self._by_object: dict[bytes, set[int]] = {}
        self._earliest = float("inf")  # no lease has an earlier deadline (releases may leave it lower)
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, meta: ObjectMeta, owner: object, location: object = None, ttl: float | None = None) -> Lease:
        lease = Lease(next(self._ids), meta, owner, time.monotonic() + (ttl or self.default_ttl), location)
        self._leases[lease.lease_id] = lease
        self._earliest = min(self._earliest, lease.deadline)
        self._by_object.setdefault(meta.object_id, set()).add(lease.lease_id)
        return lease

    def check(self, lease: Lease) -> Lease:
        current = self._leases.get(lease.lease_id)
        if current is None:
            raise LeaseError(f"lease {lease.lease_id} was released or expired")
        if current.deadline < time.monotonic():
            self.release(lease)
            self.expired_total += 1
            raise LeaseError(f"lease {lease.lease_id} passed its deadline")
        return current

    def release(self, lease: Lease) -> bool:
        if self._leases.pop(lease.lease_id, None) is None:
            return False
        ids = self._by_object.get(lease.meta.object_id)
        if ids is not None:
            ids.discard(lease.lease_id)
            if not ids:
                del self._by_object[lease.meta.object_id]
        return True

    def release_owner(self, owner: object) -> int:
        mine = [lease for lease in self._leases.values() if lease.owner == owner]
        for lease in mine:
            self.release(lease)
        return len(mine)

    def expire(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        if now <= self._earliest:  # nothing to sweep: called before every lease, keep it O(1)
            return 0
        stale = [lease for lease in self._leases.values() if lease.deadline < now]
        for lease in stale:
            self.release(lease)
        self._earliest = min((lease.deadline for lease in self._leases.values()), default=float("inf"))
        self.expired_total += len(stale)
        return len(stale)

    def is_leased(self, object_id: bytes) -> bool:
        return object_id in self._by_object

    def leased_objects(self) -> set[bytes]:
        return set(self._by_object)


class LruIndex:
    """Object metadata in least-recently-used order, with a key-digest index beside it."""

    def __init__(self) -> None:
        self._objects: OrderedDict[bytes, ObjectMeta] = OrderedDict()
        self._by_key: dict[bytes, dict[bytes, ObjectMeta]] = {}
        self.bytes_used = 0

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, object_id: bytes) -> bool:
        return object_id in self._objects

    def get(self, object_id: bytes) -> ObjectMeta | None:
        return self._objects.get(object_id)

    def add(self, meta: ObjectMeta) -> None:
        self.remove(meta.object_id)
        self._objects[meta.object_id] = meta
        self._by_key.setdefault(meta.key_digest, {})[meta.object_id] = meta
        self.bytes_used += meta.size

    def remove(self, object_id: bytes) -> ObjectMeta | None:
        meta = self._objects.pop(object_id, None)
        if meta is None:
            return None
        by_key = self._by_key.get(meta.key_digest)
        if by_key is not None:
            by_key.pop(object_id, None)
            if not by_key:
                del self._by_key[meta.key_digest]
        self.bytes_used -= meta.size
        return meta

    def touch(self, object_id: bytes) -> None:
        if object_id in self._objects:
            self._objects.move_to_end(object_id)

    def by_key(self, key_digest: bytes) -> list[ObjectMeta]:
        return list(self._by_key.get(key_digest, {}).values())

    def lru_order(self) -> list[ObjectMeta]:
        return list(self._objects.values())


class Tier(abc.ABC):
    """Every tier: device, host, disk, redis. See the module docstring for the lifecycle."""

    name: str = "tier"
    #: True when ``read`` itself verifies signature and payload digest (disk, Redis), so the
    #: engine need not hash the payload a second time.
    verifies_on_read: bool = False
    #: True when the tier has ``read_into(lease, dest)``: ``read`` straight into a buffer
    #: of the caller's (the object's exact size), verified there (disk), so a promotion
    #: reads into its arena reservation instead of a fresh buffer and a copy.
    reads_in_place: bool = False
    #: True when ``complete_store(True)`` returns only once the object is on stable storage
    #: and survives a crash of the daemon (the disk tier with fsync): what a put's
    #: ``durable`` reply promises.
    is_durable: bool = False
    #: True when the tier's bytes live in memory only the daemon can write, and got there
    #: sealed or verified (host arena, device pool): a load from it needs no digest pass in
    #: the daemon (the client verifies where the bytes land).
    holds_verified_bytes: bool = False
    #: True when ``find_by_key`` and ``prepare_load`` answer from this process's memory (no
    #: I/O): a caller asking for many keys awaits them one by one instead of a task each.
    answers_in_memory: bool = False

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket: ...

    @abc.abstractmethod
    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None:
        """Write the whole sealed object (its chunks concatenated) for ``ticket``.

        The caller keeps the buffers unchanged until ``complete_store`` returns: a tier may
        send them only then (Redis sends a one-chunk object together with its commit).
        """

    @abc.abstractmethod
    async def complete_store(self, ticket: StoreTicket, success: bool) -> None: ...

    @abc.abstractmethod
    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease: ...

    def leases_in_memory(self, object_id: bytes) -> bool:
        """True when ``prepare_load(object_id)`` would answer without I/O (a caller leasing
        many objects then awaits it in turn instead of a task each)."""
        return self.answers_in_memory

    @abc.abstractmethod
    async def read(self, lease: Lease) -> memoryview:
        """The sealed object's bytes, valid until ``complete_load(lease)``."""

    @abc.abstractmethod
    async def complete_load(self, lease: Lease) -> None: ...

    @abc.abstractmethod
    async def delete(self, object_id: bytes) -> bool:
        """Remove an object; a leased object is removed once its last lease ends."""

    @abc.abstractmethod
    async def contains(self, object_id: bytes) -> bool: ...

    @abc.abstractmethod
    async def get_meta(self, object_id: bytes) -> ObjectMeta | None: ...

    @abc.abstractmethod
    async def find_by_key(self, key_digest: bytes) -> list[ObjectMeta]: ...

    async def find_by_keys(self, key_digests: Sequence[bytes],
                           registry: VersionRegistry | None = None) -> "KeyMatches":
        """``find_by_key`` of every digest, in order. This default asks one by one (in
        memory) or concurrently; ``registry`` is only a hint: a tier on the registry's
        server may fetch the heads of the streams it found in the same round trip."""
        calls = [self.find_by_key(digest) for digest in key_digests]
        if self.answers_in_memory:
            found = []
            for call in calls:
                found.append(await call)
        else:
            found = list(await _gather_all(calls))
        return KeyMatches(found)

    @abc.abstractmethod
    def iter_objects(self) -> AsyncIterator[ObjectMeta]: ...

    @abc.abstractmethod
    async def evict(self, need_bytes: int = 0) -> list[EvictedObject]: ...

    async def evict_sparing_copies(self, need_bytes: int,
                                   is_held_below: Callable[[bytes], Awaitable[bool]]) -> list[EvictedObject]:
        """``evict``, except that a tier may skip reading the bytes of a victim for which
        ``is_held_below(object_id)`` is true and hand it back with ``blob=None``. By default
        every victim's bytes are read."""
        return await self.evict(need_bytes)

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    async def release_owner(self, owner: object) -> int:
        """Drop every lease held by ``owner`` (a client connection that went away)."""
        return 0

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
