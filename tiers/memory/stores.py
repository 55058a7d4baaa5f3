"""The store path of an extent tier: an extent reserved, written, made visible.

- ``ExtentStores(ledger, region, offers_store_view)`` — ``prepare_store`` / ``write`` /
  ``complete_store`` of ``ExtentTier`` (``tiers.memory.extent``), ``write_with`` for a
  medium's own writer (``DeviceTier.write_from_tensor``), ``close_all`` when it closes.
  The daemon's placement calls them in that order, per object.

``prepare_store`` allocates the extent (``CapacityError`` when none is free; the ticket's
``location`` is its ``PendingStore``: the offset, whether a write runs or tore; the
``Ledger`` holds the ticket, nothing beside it) and, for the host arena, hands out a view of it to fill in
place; ``complete_store(success=True)`` makes the object visible only when every byte was
written; ``success=False`` frees the extent. A write that failed or was cancelled tears the
store: only ``success=False`` may follow.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Sequence, TypeVar

from statetier.protocol.errors import CapacityError, InvalidRequest

from ..base import Buffer, ObjectMeta, StoreTicket
from ..ledger import Ledger
from .rawmemory import byte_view, release_quietly
from .records import ObjectExtent, PendingStore
from .region import ExtentRegion

S = TypeVar("S")


class ExtentStores:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[ObjectExtent], region: ExtentRegion, offers_store_view: bool) -> None:
        self._ledger = ledger
        self._region = region
        self._offers_view = offers_store_view

    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket:
        space = self._region.space
        oid = meta.object_id
        if oid in space.places or self._ledger.is_hidden(oid) or self._ledger.is_storing(oid):
            raise InvalidRequest(f"object {oid.hex()} is already stored (or being stored) in {self._ledger.name}")
        if meta.size <= 0:
            raise InvalidRequest(f"object {oid.hex()} has no bytes")
        offset = space.alloc.allocate(meta.size)
        if offset is None:
            raise CapacityError(f"{self._ledger.name}: no extent of {meta.size} bytes is free", tier=self._ledger.name,
                                need=meta.size, free_bytes=space.alloc.free_bytes,
                                largest_free=space.alloc.largest_free)
        view = space.bytes.view(offset, meta.size) if self._offers_view else None
        return self._ledger.open_store(meta, PendingStore(offset), view)

    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None:
        try:
            views = [byte_view(chunk) for chunk in chunks]
        except TypeError as exc:
            raise InvalidRequest(f"write() takes buffers: {exc}") from exc
        await self.write_with(ticket, sum(v.nbytes for v in views), self._region.space.bytes.write_chunks, views)

    async def write_with(self, ticket: StoreTicket, nbytes: int,
                         writer: Callable[[int, int, S], Awaitable[None]], source: S) -> None:
        """Run ``writer(extent, position, source)`` for the next ``nbytes`` of ``ticket``."""
        self._region.require_open()
        store = self._pending_store(ticket)
        if store is None:
            raise InvalidRequest("unknown or already completed store ticket")
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
        store = self._pending_store(ticket)
        if store is None:
            if success:
                raise InvalidRequest("unknown or already completed store ticket")
            return
        self._ledger.close_store(ticket)
        meta = ticket.meta
        release_quietly(ticket.view)
        ticket.view = None
        if not success:
            self._region.free(store.offset)
            return
        filled = (0, meta.size) if self._offers_view else (meta.size,)
        if store.is_torn or store.is_writing or ticket.written not in filled:
            self._region.free(store.offset)
            raise InvalidRequest(f"store of {meta.object_id.hex()} is incomplete ({ticket.written}/{meta.size} bytes)")
        space = self._region.current
        assert space is not None  # an open store means an open (or closing) region
        space.place(meta.object_id, store.offset, meta.size)
        self._ledger.index.add(meta)

    def close_all(self) -> None:
        """Forget every store in progress, releasing the views handed out (the tier closes)."""
        for ticket in self._ledger.close_all_stores():
            release_quietly(ticket.view)

    def _pending_store(self, ticket: StoreTicket) -> PendingStore | None:
        """The store in progress ``ticket`` names (its ``location``), if the ledger has it open."""
        store = ticket.location
        return store if isinstance(store, PendingStore) and self._ledger.is_open(ticket) else None
