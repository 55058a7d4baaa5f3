"""The one tier interface and its value objects (the bookkeeping every tier keeps: ``ledger``).

A tier stores sealed objects (``header + payload`` bytes, see ``statetier.protocol.sealed``)
under their ``object_id`` (the 16-byte state_id) and indexes them by ``key_digest``
(``StateKey.digest()``). Lifecycle, always paired in ``try/finally``:

    ticket = await tier.prepare_store(meta)         # reserves room, or CapacityError
    await tier.write(ticket, chunks)                # or fill ``ticket.view`` in place
    await tier.complete_store(ticket, success=True) # visible only now; False frees it all
                                                    # (complete_stores: a batch at once)

    lease = await tier.prepare_load(object_id, owner=conn_id)   # pins bytes, or NotFound
    data = await tier.read(lease)                   # memoryview valid until complete_load
    data = await tier.read(lease, into=view, verify=False)  # into the caller's buffer; no payload digest
    await tier.complete_load(lease)                 # unpins

``find_by_keys(digests, registry)`` finds many keys at once (one round trip for a tier
behind the network; ``find_by_key`` is it for one key); a tier that shares the registry's server may
also bring back the stream heads of what it found (``KeyMatches.heads``), so a whole
request's lookup costs the same few round trips whatever its number of objects.

``evict()`` removes least-recently-used unleased objects until usage is under the low
watermark and returns them *with their bytes*, so the caller can demote rather than drop;
``evict_sparing_copies(need, is_held_below)`` may leave out the bytes of victims a lower
tier already holds.
``compact()`` (disk segments, the memory tiers' regions; a no-op returning None elsewhere)
never moves or frees bytes under a lease; its report is a ``CompactionReport``.
Foreign exceptions never leave a tier: each translates them into ``statetier`` errors.
``PurgeMarkStore`` is the capability a tier declares (by implementing it) when it keeps the
cluster's purge marks (the shared Redis tier); ``holds_bytes = False`` declares a tier that
takes no bytes of its own (the peer tier: it describes what this daemon's other tiers hold).
``Clock`` is what a tier reads lease deadlines on (``time.monotonic`` unless its options say).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Self, Sequence, runtime_checkable

from statetier.protocol.errors import StatetierError
from statetier.protocol.identity import Kind
from statetier.protocol.sealed import SealedHeader
from statetier.tiers.registry import StreamHead, VersionRegistry

Buffer = bytes | bytearray | memoryview


class Clock(Protocol):
    """Seconds that never go back, which lease deadlines are set and checked on.

    ``time.monotonic`` unless a tier's options name another (``clock=``: a test advances one
    by hand instead of sleeping past a lease's TTL)."""

    def __call__(self) -> float: ...


class CompactionReport(Protocol):
    """What one ``compact`` pass did, in each tier's own report (``SegmentCompactionReport``,
    ``ExtentCompactionReport``); every one says how many objects it moved."""

    @property
    def objects_moved(self) -> int: ...


@dataclass(slots=True)
class KeyMatches:
    """What ``Tier.find_by_keys`` found: per digest, the objects (oldest version first);
    ``heads``: stream id → newest head (None: no head), for the streams the tier could
    ask the registry about on the way (may be empty, never wrong)."""

    metas: list[list["ObjectMeta"]]
    heads: dict[bytes, StreamHead | None] = field(default_factory=dict)
    #: the cluster's purge marks (scope → cutoff), read on the way by a shared tier that keeps
    #: them (``tiers.redis``: in the same round trip); None where not asked
    purge_marks: dict[str, int] | None = None


@runtime_checkable
class PurgeMarkStore(Protocol):
    """A tier that keeps the cluster's purge marks (the shared Redis tier declares it): a purge
    on one daemon is recorded (``mark_purge``) so every daemon sharing it removes its copies
    too (``purge_marks``: scope → cutoff). Checked once, by the composition root."""

    async def mark_purge(self, scope: str, cutoff_ns: int) -> None: ...

    async def purge_marks(self) -> dict[str, int]: ...


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
    deadline: float  # seconds on the tier's Clock
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
    extra: dict[str, Any] = field(default_factory=dict)


class Tier(abc.ABC):
    """Every tier: device, host, disk, redis. See the module docstring for the lifecycle."""

    name: str = "tier"
    #: True when ``read(verify=True)`` itself checks signature and payload digest (disk,
    #: Redis), so the engine need not hash the payload a second time (a client's recheck).
    verifies_on_read: bool = False
    #: True when ``complete_store(True)`` returns only once the object is on stable storage
    #: and survives a crash of the daemon (the disk tier with fsync): what a put's
    #: ``durable`` reply promises.
    is_durable: bool = False
    #: True when ``find_by_key`` and ``prepare_load`` answer from this process's memory (no
    #: I/O): a caller asking for many keys awaits them one by one instead of a task each.
    answers_in_memory: bool = False
    #: False for a tier that describes objects held elsewhere (the peer tier): placement
    #: never stores, demotes or writes behind into it; a copy found there is pulled.
    holds_bytes: bool = True

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

    async def complete_stores(self, tickets: Sequence[StoreTicket]) -> list[StatetierError | None]:
        """``complete_store(ticket, True)`` of each written ticket, in order: ``None`` for
        each object stored, the error of each refused in its place. A tier behind the network
        commits them together (Redis: one script call for the batch); by default one by one."""
        out: list[StatetierError | None] = []
        for ticket in tickets:
            try:
                await self.complete_store(ticket, True)
                out.append(None)
            except StatetierError as exc:
                out.append(exc)
        return out

    @abc.abstractmethod
    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease: ...

    def leases_in_memory(self, object_id: bytes) -> bool:
        """True when ``prepare_load(object_id)`` would answer without I/O (a caller leasing
        many objects then awaits it in turn instead of a task each)."""
        return self.answers_in_memory

    @abc.abstractmethod
    async def read(self, lease: Lease, *, into: memoryview | None = None, verify: bool = True) -> memoryview:
        """The sealed object's bytes, valid until ``complete_load(lease)``: with ``into`` (a
        writable buffer of the object's size, a promotion's reservation) read straight into
        it and returned as a view of it, no fresh buffer. ``verify=False`` skips the pass over
        the payload (framing and signature are checked as ever): for a load whose client
        verifies the payload where it lands (docs/protocol.md §6.1, the hashing rule); a tier
        that digests nothing on a read (memory) reads the same either way. A tier that
        ``verifies_on_read`` drops a damaged object and raises its rejection."""

    @abc.abstractmethod
    async def complete_load(self, lease: Lease) -> None: ...

    @abc.abstractmethod
    async def delete(self, object_id: bytes) -> bool:
        """Remove an object; a leased object is removed once its last lease ends."""

    @abc.abstractmethod
    async def contains(self, object_id: bytes) -> bool: ...

    @abc.abstractmethod
    async def get_meta(self, object_id: bytes) -> ObjectMeta | None: ...

    async def find_by_key(self, key_digest: bytes) -> list[ObjectMeta]:
        """The objects stored under one key digest, oldest version first: ``find_by_keys``
        of one key (the one implementation of a find)."""
        return (await self.find_by_keys((key_digest,))).metas[0]

    @abc.abstractmethod
    async def find_by_keys(self, key_digests: Sequence[bytes],
                           registry: VersionRegistry | None = None) -> KeyMatches:
        """What is stored under each digest, in order. ``registry`` is only a hint: a tier
        on the registry's server may fetch the heads of the streams it found in the same
        round trip."""

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

    async def compact(self) -> CompactionReport | None:
        """One compaction pass (never moving or freeing leased bytes); None where the tier
        has nothing to compact (Redis)."""
        return None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
