"""The bookkeeping of a tier whose objects live in extents of one preallocated region.

- ``ExtentTier``       — the ``Tier`` lifecycle for the host arena (``tiers.memory.host``) and the
                         device pool (``tiers.memory.device``): reservations counted against capacity,
                         visibility at ``complete_store(success=True)``, leases, exact LRU
                         eviction, deletes deferred past the last lease, and ``compact()``.
                         A subclass opens and closes the medium (``_open_medium`` /
                         ``_close_medium``, run in the executor). The byte movers below work on
                         host memory (``_region`` at ``_region_address``); the CUDA pool
                         overrides them.
- ``Placement``        — where one visible object lives: offset, size, generation.
- ``CompactionReport`` — what one ``compact()`` pass did.

Views returned by ``read`` are released at ``complete_load``, so a late reader fails with
``ValueError`` instead of reading reused space. A tensor built with ``torch.frombuffer``
over such a view holds no buffer export and is not protected: finish with it first.

Bookkeeping runs on the event loop only; executor threads only copy bytes. Two rules keep
the bytes safe without locks:

- a job pins the extents it touches, and freeing a pinned extent waits for the job, so a
  cancelled write or move never scribbles on space that was handed out again;
- compaction copies an unleased object to a lower extent, then commits only if the object
  is still there and still unleased. A lease granted during the copy reads the old bytes,
  which nobody writes, and the move is abandoned (counted in ``compactions_blocked``). No
  reader can see half-moved bytes, and leased bytes never move.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

from statetier.protocol.errors import (
    CapacityError,
    ConfigError,
    InternalError,
    InvalidRequest,
    LeaseError,
    NotFound,
    StatetierError,
)

from ..allocator import ExtentAllocator
from ..base import Buffer, EvictedObject, Lease, LeaseTable, LruIndex, ObjectMeta, StoreTicket, Tier, TierStats
from .rawmemory import copy_bytes, exported, exported_for_write, fresh_buffer

#: Copies up to this size run on the loop (memoryview slice assignment); larger ones in the
#: executor with the GIL released. A thread hop costs about as much as copying 512 KiB.
DEFAULT_INLINE_COPY_BYTES = 512 * 1024


@dataclass(slots=True)
class Placement:
    offset: int  # start of the object's extent in the region
    nbytes: int  # the object's size (the extent may be rounded up)
    generation: int  # changes whenever the object moves
    touched: int  # LRU stamp, so eviction notices a load that raced its copy


@dataclass(frozen=True, slots=True)
class CompactionReport:
    moved: int
    bytes_moved: int
    blocked: int  # moves prevented by a lease
    largest_free_before: int
    largest_free_after: int


@dataclass(slots=True)
class _Store:
    offset: int
    is_writing: bool = False
    is_torn: bool = False  # a write failed or was cancelled: only success=False may follow


@dataclass(slots=True)
class LeaseState:
    lease: Lease
    views: list[memoryview] = field(default_factory=list)  # released at complete_load
    keepalive: list[object] = field(default_factory=list)  # staging buffers behind views


def byte_view(chunk: Buffer) -> memoryview:
    """A flat, contiguous ``B`` view of any buffer (non-contiguous ones are copied)."""
    view = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def release_quietly(view: memoryview | None) -> None:
    """Release our reference; a view still exported elsewhere lives on until that ends."""
    if view is not None:
        try:
            view.release()
        except BufferError:
            pass


class ExtentTier(Tier):
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
        self._stores: dict[int, tuple[StoreTicket, _Store]] = {}
        self._storing: set[bytes] = set()
        self._reserved_bytes = self._hidden_bytes = 0
        self._leases = LeaseTable(lease_ttl)
        self._lease_states: dict[int, LeaseState] = {}
        self._ticket_ids, self._generations, self._touches = itertools.count(1), itertools.count(1), itertools.count(1)
        self._pins: dict[int, int] = {}
        self._deferred_frees: set[int] = set()
        self._jobs: set[Future] = set()
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
        self._is_open = True

    async def close(self) -> None:
        if not self._is_open:
            return
        self._is_open = False
        if self._jobs:  # copies still running for cancelled callers: let them land
            await asyncio.gather(*(asyncio.wrap_future(job) for job in list(self._jobs)), return_exceptions=True)
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
        self._stores[ticket.ticket_id] = (ticket, _Store(offset))
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

    # ------------------------------------------------------------------ load

    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease:
        self._require_open()
        placement = self._places.get(object_id)
        if placement is None:
            raise NotFound(f"object {object_id.hex()} is not in {self.name}")
        lease = self._leases.grant(self._index.get(object_id), owner, (placement.offset, placement.generation), ttl)
        self._lease_states[lease.lease_id] = LeaseState(lease)
        self._index.touch(object_id)
        placement.touched = next(self._touches)
        return lease

    async def read(self, lease: Lease) -> memoryview:
        placement = self._leased_placement(lease)
        view = await self._read_view(self._lease_states[lease.lease_id], placement)
        return self._track_view(lease, view)

    async def read_into(self, lease: Lease, dest: Buffer) -> int:
        """Copy the leased object into ``dest`` (writable, at least its size); returns the size."""
        placement = self._leased_placement(lease)
        try:
            with exported_for_write(dest) as (_, room):
                pass
        except (BufferError, TypeError) as exc:
            raise InvalidRequest(f"read_into needs a writable contiguous buffer: {exc}") from exc
        if room < placement.nbytes:
            raise InvalidRequest(f"destination holds {room} bytes; the object has {placement.nbytes}")
        await self._copy_to(placement, dest)
        self._leased_placement(lease)  # still leased: the copy is what the lease pinned
        return placement.nbytes

    async def complete_load(self, lease: Lease) -> None:
        self._end_lease(lease)

    async def release_owner(self, owner: object) -> int:
        mine = [state.lease for state in self._lease_states.values() if state.lease.owner == owner]
        for lease in mine:
            self._end_lease(lease)
        return len(mine)

    def _leased_placement(self, lease: Lease) -> Placement:
        self._require_open()
        try:
            current = self._leases.check(lease)
        except LeaseError:
            self._end_lease(lease)
            raise
        if current is not lease and current.meta.object_id != lease.meta.object_id:
            raise LeaseError(f"lease {lease.lease_id} does not belong to {self.name}")
        placement = self._places.get(lease.object_id)
        if placement is None and lease.object_id in self._hidden:
            placement = self._hidden[lease.object_id][1]
        if placement is None or (placement.offset, placement.generation) != lease.location:
            self.lease_violations += 1
            raise InternalError(f"{self.name}: leased object {lease.object_id.hex()} moved")
        return placement

    def _track_view(self, lease: Lease, view: memoryview) -> memoryview:
        state = self._lease_states.get(lease.lease_id)
        if state is None:  # released while the bytes were being copied
            release_quietly(view)
            raise LeaseError(f"lease {lease.lease_id} ended during the read")
        state.views.append(view)
        return view

    def _end_lease(self, lease: Lease) -> None:
        self._leases.release(lease)
        state = self._lease_states.pop(lease.lease_id, None)
        if state is not None:
            for view in state.views:
                release_quietly(view)
            state.keepalive.clear()
        self._maybe_reap(lease.object_id)

    def expire_leases(self) -> int:
        """Drop leases past their deadline (and free what they alone kept); for maintenance.

        ``evict`` and ``compact`` call it first; a lease is also refused on use once late.
        """
        now = time.monotonic()
        stale = [state.lease for state in self._lease_states.values() if state.lease.deadline < now]
        for lease in stale:
            self._leases.expired_total += 1
            self._end_lease(lease)
        return len(stale)

    def _maybe_reap(self, object_id: bytes) -> None:
        if object_id in self._hidden and not self._leases.is_leased(object_id):
            meta, placement = self._hidden.pop(object_id)
            self._hidden_bytes -= meta.size
            self._free_extent(placement.offset)

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

    # ------------------------------------------------------------------ compaction

    async def compact(self) -> CompactionReport:
        """Slide unleased objects down into free extents below them, highest first."""
        self._require_open()
        async with self._compaction:
            self.expire_leases()
            before = self._alloc.largest_free
            moved = bytes_moved = blocked = 0
            try:
                for oid, placement in sorted(self._places.items(), key=lambda item: -item[1].offset):
                    outcome = await self._maybe_move(oid, placement)
                    if outcome is None:
                        blocked += 1
                    elif outcome:
                        moved += 1
                        bytes_moved += placement.nbytes
            finally:
                after = self._alloc.largest_free if self._alloc is not None else before
                self.compactions_run += 1
                self.compactions_blocked += blocked
                self.bytes_moved += bytes_moved
                self.bytes_reclaimed += max(0, after - before)
        return CompactionReport(moved, bytes_moved, blocked, before, after)

    async def _maybe_move(self, oid: bytes, placement: Placement) -> bool | None:
        """True when moved, False when there was nowhere lower to go, None when a lease blocked it."""
        if self._places.get(oid) is not placement:
            return False
        dst = self._alloc.allocate_lowest(self._alloc.size_of(placement.offset), below=placement.offset)
        if dst is None:
            return False
        if self._leases.is_leased(oid):
            self._free_extent(dst)
            return None
        src, generation = placement.offset, placement.generation
        try:
            await self._move(src, dst, placement.nbytes)
        except BaseException:
            self._free_extent(dst)
            raise
        if self._places.get(oid) is not placement or placement.generation != generation or self._leases.is_leased(oid):
            self._free_extent(dst)
            return None if self._places.get(oid) is placement else False
        placement.offset, placement.generation = dst, next(self._generations)
        self._free_extent(src)
        return True

    # ------------------------------------------------------------------ byte movers (host memory)

    async def _write_chunks(self, extent: int, position: int, views: list[memoryview]) -> None:
        if sum(v.nbytes for v in views) <= self._inline_copy_bytes:
            for view in views:
                self._region[position : position + view.nbytes] = view
                position += view.nbytes
            return
        await self._run_job((extent,), self._copy_in_job, position, views)

    def _copy_in_job(self, position: int, views: list[memoryview]) -> None:
        for view in views:
            with exported(view) as (address, nbytes):
                copy_bytes(self._region_address + position, address, nbytes)
            position += nbytes

    async def _read_view(self, state: LeaseState, placement: Placement) -> memoryview:
        return self._region[placement.offset : placement.offset + placement.nbytes].toreadonly()

    async def _copy_to(self, placement: Placement, dest: Buffer) -> None:
        if placement.nbytes <= self._inline_copy_bytes:
            byte_view(dest)[: placement.nbytes] = self._region[placement.offset : placement.offset + placement.nbytes]
            return
        await self._run_job((placement.offset,), self._copy_to_job, placement.offset, placement.nbytes, dest)

    def _copy_to_job(self, offset: int, nbytes: int, dest: Buffer) -> None:
        with exported_for_write(dest) as (address, _):
            copy_bytes(address, self._region_address + offset, nbytes)

    async def _copy_out(self, placements: list[Placement]) -> list[Buffer]:
        if not placements:
            return []
        if sum(p.nbytes for p in placements) <= self._inline_copy_bytes:
            return [bytes(self._region[p.offset : p.offset + p.nbytes]) for p in placements]
        items = [(p.offset, p.nbytes) for p in placements]
        return await self._run_job(tuple(offset for offset, _ in items), self._copy_out_job, items)

    def _copy_out_job(self, items: list[tuple[int, int]]) -> list[memoryview]:
        blobs = []
        for offset, nbytes in items:
            blob = fresh_buffer(nbytes)
            self._copy_to_job(offset, nbytes, blob)
            blobs.append(blob)
        return blobs

    async def _move(self, src: int, dst: int, nbytes: int) -> None:
        if nbytes <= self._inline_copy_bytes:
            self._region[dst : dst + nbytes] = self._region[src : src + nbytes]
            return
        await self._run_job((src, dst), copy_bytes, self._region_address + dst, self._region_address + src, nbytes)

    # ------------------------------------------------------------------ executor jobs and pins

    async def _run_job(self, extents: tuple[int, ...], fn: Callable, *args):
        """Run ``fn`` in the executor with ``extents`` pinned until it ends, even if we are cancelled."""
        for extent in extents:
            self._pins[extent] = self._pins.get(extent, 0) + 1
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            self._unpin(extents)
            raise
        self._jobs.add(job)
        loop = self._loop
        # the callback takes the job as its argument: closing over it would make a cycle
        # (job → callbacks → closure → job) that keeps the job's result — copies of whole
        # objects — alive until the garbage collector runs
        job.add_done_callback(lambda done: loop.call_soon_threadsafe(self._job_finished, done, extents))
        try:
            return await asyncio.wrap_future(job)
        except (StatetierError, asyncio.CancelledError):
            raise
        except MemoryError as exc:
            raise CapacityError(f"{self.name}: out of memory while copying") from exc
        except Exception as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: Exception) -> StatetierError:
        return InternalError(f"{self.name}: copy failed: {exc}")

    def _job_finished(self, job: Future, extents: tuple[int, ...]) -> None:
        self._jobs.discard(job)
        self._unpin(extents)

    def _unpin(self, extents: tuple[int, ...]) -> None:
        for extent in extents:
            left = self._pins[extent] - 1
            if left:
                self._pins[extent] = left
                continue
            del self._pins[extent]
            if extent in self._deferred_frees:
                self._deferred_frees.discard(extent)
                if self._alloc is not None:
                    self._alloc.free(extent)

    def _free_extent(self, extent: int) -> None:
        if self._pins.get(extent):
            self._deferred_frees.add(extent)
        else:
            self._alloc.free(extent)

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
