"""The bookkeeping of a tier whose objects live in extents of one preallocated region.

- ``ExtentTier`` — the ``Tier`` lifecycle for the host arena (``tiers.memory.host``) and the
  device pool (``tiers.memory.device``): reservations counted against capacity, visibility
  at ``complete_store(success=True)``, leases, exact LRU eviction, deletes deferred past the
  last lease, and ``compact()``. A subclass opens and closes the medium (``_open_medium`` /
  ``_close_medium``, run in the executor) and moves its bytes (``_write_chunks``,
  ``_read_view``, ``_copy_to``, ``_copy_out``, ``_move``), through ``_run_job`` when large.
- ``DEFAULT_INLINE_COPY_BYTES`` — copies up to this size run on the event loop.

It is composed of parts in their own modules: ``tiers.memory.load`` (``ExtentLoads``:
leases and reads) and ``tiers.memory.compaction`` (``Compaction``: ``compact()``); what it
records per object, store and lease is in ``tiers.memory.placement``, the executor jobs and
the extents they pin in ``tiers.memory.pins`` (a free waits for the jobs pinning the extent,
so a cancelled write or move never scribbles on space that was handed out again).
Bookkeeping runs on the event loop only; executor threads only copy bytes.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import AsyncIterator, Awaitable, Callable, Sequence

from statetier.protocol.errors import (
    CapacityError,
    ConfigError,
    InternalError,
    InvalidRequest,
    StatetierError,
)

from statetier.protocol.extents import ExtentAllocator
from ..base import Buffer, EvictedObject, LeaseTable, LruIndex, ObjectMeta, StoreTicket, Tier, TierStats
from .compaction import Compaction
from .load import ExtentLoads
from .pins import PinnedJobs
from .placement import LeaseState, PendingStore, Placement
from .rawmemory import byte_view, release_quietly

#: Copies up to this size run on the loop (memoryview slice assignment); larger ones in the
#: executor with the GIL released. A thread hop costs about as much as copying 512 KiB.
DEFAULT_INLINE_COPY_BYTES = 512 * 1024


class ExtentTier(ExtentLoads, Compaction, Tier):
    """See the module docstring. Subclasses set ``offers_store_view`` and the medium hooks."""

    offers_store_view = False
    answers_in_memory = True  # the index and leases are dicts of this process

    def __init__(self, capacity_bytes: int, *, high_watermark: float, low_watermark: float, lease_ttl: float,
                 executor: Executor | None, name: str, granularity: int, inline_copy_bytes: int) -> None:
        if capacity_bytes < granularity:
            raise ConfigError(f"{name}: capacity_bytes {capacity_bytes} is below one granule ({granularity})")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ConfigError(f"{name}: need 0 < low_watermark <= high_watermark <= 1")
        self.name = name
        self.capacity = capacity_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self._granularity = granularity
        self._inline_copy_bytes = inline_copy_bytes
        self._given_executor = executor
        self._executor: Executor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._alloc: ExtentAllocator | None = None
        self._region: memoryview | None = None
        self._region_address = 0
        self._index = LruIndex()
        self._places: dict[bytes, Placement] = {}
        self._hidden: dict[bytes, tuple[ObjectMeta, Placement]] = {}  # deleted, still leased
        self._stores: dict[int, tuple[StoreTicket, PendingStore]] = {}
        self._storing: set[bytes] = set()
        self._reserved_bytes = self._hidden_bytes = 0
        self._leases = LeaseTable(lease_ttl)
        self._lease_states: dict[int, LeaseState] = {}
        self._ticket_ids, self._generations, self._touches = itertools.count(1), itertools.count(1), itertools.count(1)
        self._pinned: PinnedJobs | None = None  # from start() to close()
        self._compaction = asyncio.Lock()
        self._is_open = False
        self.evictions = self.compactions_run = self.compactions_blocked = 0
        self.bytes_reclaimed = self.bytes_moved = self.lease_violations = 0

    # ------------------------------------------------------------------ medium hooks

    def _open_medium(self) -> None:
        """Create the region (executor thread); set ``_region``/``_region_address`` for host memory."""
        raise NotImplementedError

    def _close_medium(self) -> None:
        raise NotImplementedError

    async def _write_chunks(self, extent: int, position: int, views: list[memoryview]) -> None:
        """Copy ``views`` into the region at ``position`` (inside ``extent``)."""
        raise NotImplementedError

    async def _read_view(self, state: LeaseState, placement: Placement) -> memoryview:
        """A read-only view of the object (staging buffers kept in ``state``)."""
        raise NotImplementedError

    async def _copy_to(self, placement: Placement, dest: Buffer) -> None:
        raise NotImplementedError

    async def _copy_out(self, placements: list[Placement]) -> list[Buffer]:
        """Fresh copies of the objects (for eviction)."""
        raise NotImplementedError

    async def _move(self, src: int, dst: int, nbytes: int) -> None:
        raise NotImplementedError

    def _translate(self, exc: Exception) -> StatetierError:
        """What a failed copy job raises (``PinnedJobs``)."""
        return InternalError(f"{self.name}: copy failed: {exc}")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._is_open:
            return
        self._loop = asyncio.get_running_loop()
        self._executor = self._given_executor or ThreadPoolExecutor(2, thread_name_prefix=f"statetier-{self.name}")
        opening = self._executor.submit(self._open_medium)
        try:
            await asyncio.wrap_future(opening)
        except BaseException:
            opening.add_done_callback(
                lambda done: not done.cancelled() and done.exception() is None and self._close_medium())
            self._drop_executor()
            raise
        self._alloc = ExtentAllocator(self.capacity, self._granularity)
        self._pinned = PinnedJobs(self._executor, self._loop, self._alloc, self._translate, self.name)
        self._is_open = True

    async def close(self) -> None:
        if not self._is_open:
            return
        self._is_open = False
        await self._pinned.wait_all()
        for state in list(self._lease_states.values()):
            self._end_lease(state.lease)
        for ticket, _ in self._stores.values():
            release_quietly(ticket.view)
        self._stores.clear()
        self._storing.clear()
        self._places.clear()
        self._hidden.clear()
        self._index = LruIndex()
        self._reserved_bytes = self._hidden_bytes = 0
        self._alloc = None
        self._pinned.detach()
        try:
            await self._loop.run_in_executor(self._executor, self._close_medium)
        finally:
            self._drop_executor()

    def _drop_executor(self) -> None:
        if self._given_executor is None and self._executor is not None:
            self._executor.shutdown(wait=False)
        self._executor = None

    def _require_open(self) -> None:
        if not self._is_open:
            raise RuntimeError(f"the {self.name} tier is not started (or already closed)")

    # ------------------------------------------------------------------ store

    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket:
        self._require_open()
        oid = meta.object_id
        if oid in self._places or oid in self._hidden or oid in self._storing:
            raise InvalidRequest(f"object {oid.hex()} is already stored (or being stored) in {self.name}")
        if meta.size <= 0:
            raise InvalidRequest(f"object {oid.hex()} has no bytes")
        offset = self._alloc.allocate(meta.size)
        if offset is None:
            raise CapacityError(f"{self.name}: no extent of {meta.size} bytes is free", tier=self.name,
                                need=meta.size, free_bytes=self._alloc.free_bytes, largest_free=self._alloc.largest_free)
        view = self._region[offset : offset + meta.size] if self.offers_store_view else None
        ticket = StoreTicket(meta, next(self._ticket_ids), view=view, location=offset)
        self._stores[ticket.ticket_id] = (ticket, PendingStore(offset))
        self._storing.add(oid)
        self._reserved_bytes += meta.size
        return ticket

    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None:
        try:
            views = [byte_view(chunk) for chunk in chunks]
        except TypeError as exc:
            raise InvalidRequest(f"write() takes buffers: {exc}") from exc
        await self._write_guarded(ticket, sum(v.nbytes for v in views), self._write_chunks, views)

    async def _write_guarded(self, ticket: StoreTicket, nbytes: int, writer: Callable, source: object) -> None:
        """Run ``writer(extent, position, source)`` for the next ``nbytes`` of ``ticket``."""
        self._require_open()
        entry = self._stores.get(ticket.ticket_id)
        if entry is None or entry[0] is not ticket:
            raise InvalidRequest("unknown or already completed store ticket")
        store = entry[1]
        if store.is_writing or store.is_torn:
            raise InvalidRequest("this ticket has a write in progress, or one that failed")
        if ticket.written + nbytes > ticket.meta.size:
            raise InvalidRequest(f"writing {ticket.written + nbytes} bytes into an object of {ticket.meta.size}")
        store.is_writing = True
        try:
            await writer(store.offset, store.offset + ticket.written, source)
        except BaseException:
            store.is_torn = True
            raise
        finally:
            store.is_writing = False
        ticket.written += nbytes

    async def complete_store(self, ticket: StoreTicket, success: bool) -> None:
        entry = self._stores.get(ticket.ticket_id)
        if entry is None or entry[0] is not ticket:
            if success:
                raise InvalidRequest("unknown or already completed store ticket")
            return
        store = self._stores.pop(ticket.ticket_id)[1]
        meta = ticket.meta
        self._storing.discard(meta.object_id)
        self._reserved_bytes -= meta.size
        release_quietly(ticket.view)
        ticket.view = None
        if not success:
            self._free_extent(store.offset)
            return
        filled = (0, meta.size) if self.offers_store_view else (meta.size,)
        if store.is_torn or store.is_writing or ticket.written not in filled:
            self._free_extent(store.offset)
            raise InvalidRequest(f"store of {meta.object_id.hex()} is incomplete ({ticket.written}/{meta.size} bytes)")
        self._places[meta.object_id] = Placement(store.offset, meta.size, next(self._generations), next(self._touches))
        self._index.add(meta)

    # ------------------------------------------------------------------ index

    async def delete(self, object_id: bytes) -> bool:
        self._require_open()
        placement = self._places.pop(object_id, None)
        if placement is None:
            return False
        meta = self._index.remove(object_id)
        if self._leases.is_leased(object_id):
            self._hidden[object_id] = (meta, placement)
            self._hidden_bytes += meta.size
        else:
            self._free_extent(placement.offset)
        return True

    async def contains(self, object_id: bytes) -> bool:
        return object_id in self._places

    async def get_meta(self, object_id: bytes) -> ObjectMeta | None:
        return self._index.get(object_id)

    async def find_by_key(self, key_digest: bytes) -> list[ObjectMeta]:
        return self._index.by_key(key_digest)

    async def iter_objects(self) -> AsyncIterator[ObjectMeta]:
        for meta in self._index.lru_order():
            if meta.object_id in self._places:
                yield meta

    @property
    def bytes_used(self) -> int:
        """Object bytes held: visible, reserved by stores in progress, deleted but leased."""
        return self._index.bytes_used + self._reserved_bytes + self._hidden_bytes

    # ------------------------------------------------------------------ eviction

    async def evict(self, need_bytes: int = 0) -> list[EvictedObject]:
        return await self.evict_sparing_copies(need_bytes, None)

    async def evict_sparing_copies(self, need_bytes: int,
                                   is_held_below: Callable[[bytes], Awaitable[bool]] | None) -> list[EvictedObject]:
        self._require_open()
        self.expire_leases()
        if self.bytes_used + need_bytes <= self.high_watermark * self.capacity:
            return []
        excess = self.bytes_used + need_bytes - self.low_watermark * self.capacity
        victims, chosen = [], 0
        for meta in self._index.lru_order():
            if chosen >= excess:
                break
            if not self._leases.is_leased(meta.object_id):
                placement = self._places[meta.object_id]
                victims.append((meta, placement, placement.touched))
                chosen += meta.size
        if not victims:
            return []
        # a victim with a copy below leaves without its bytes being copied out (the copy is
        # what a write-behind already made: copying it out again only to drop it cost a
        # whole watermark band of memcpy per eviction)
        spared = [is_held_below is not None and await is_held_below(meta.object_id) for meta, _, _ in victims]
        copied = await self._copy_out([placement for (_, placement, _), kept in zip(victims, spared) if not kept])
        blobs = iter(copied)
        evicted = []
        for (meta, placement, touched), kept in zip(victims, spared):
            blob = None if kept else next(blobs)
            oid = meta.object_id
            if self._places.get(oid) is not placement or placement.touched != touched or self._leases.is_leased(oid):
                continue  # loaded or deleted while its bytes were copied out: it stays (or is gone)
            del self._places[oid]
            self._index.remove(oid)
            self._free_extent(placement.offset)
            evicted.append(EvictedObject(meta, blob))
        self.evictions += len(evicted)
        return evicted

    # ------------------------------------------------------------------ executor jobs and pins

    async def _run_job(self, extents: tuple[int, ...], fn: Callable, *args):
        """Run ``fn`` in the executor with ``extents`` pinned until it ends (``PinnedJobs.run``)."""
        return await self._pinned.run(extents, fn, *args)

    def _free_extent(self, extent: int) -> None:
        self._pinned.free(extent)

    # ------------------------------------------------------------------ stats

    def stats(self) -> TierStats:
        alloc = self._alloc
        return TierStats(
            tier=self.name,
            objects=len(self._places),
            bytes_used=self.bytes_used,
            capacity=self.capacity,
            leases=len(self._leases),
            inflight=len(self._stores) + len(self._leases),
            evictions=self.evictions,
            compactions_run=self.compactions_run,
            compactions_blocked=self.compactions_blocked,
            bytes_reclaimed=self.bytes_reclaimed,
            extra={
                "granularity": self._granularity,
                "extent_bytes_allocated": alloc.used_bytes if alloc else 0,
                "largest_free_extent": alloc.largest_free if alloc else 0,
                "fragmentation": alloc.fragmentation if alloc else 0.0,
                "bytes_moved": self.bytes_moved,
                "deleted_but_leased": len(self._hidden),
                "leases_expired": self._leases.expired_total,
                "lease_violations": self.lease_violations,
            },
        )
