"""The store path of ``DiskTier``: a reserved record range, then a group commit.

- ``DiskStores`` — ``prepare_store`` / ``write`` / ``complete_store`` of ``DiskTier`` (a
  part ``tiers.disk.tier`` composes; the state it uses is declared in
  ``DiskTier.__init__``), called by the daemon's placement per object, in that order.
- ``Reservation`` — ``StoreTicket.location`` of this tier: one reserved record range.
- ``BUFFERED_BYTES`` — objects up to this size are buffered by ``write`` and written by
  the commit job (saving a trip to the executor).

``prepare_store`` reserves a range of the active segment (concurrent stores write in
parallel), refusing a store that would leave the filesystem less than ``free_space_reserve``.
``complete_store(True)`` appends a COMMIT record naming the object and fdatasyncs both at
once (the group commit, ``tiers.disk.commit``): once it returns the object survives kill -9
and a power cut. Anything less than a completed store leaves dead bytes only.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from functools import partial
from typing import Sequence

from statetier.protocol.errors import CapacityError, InvalidRequest, StatetierError
from ..base import Buffer, ObjectMeta, StoreTicket
from .commit import RecordWrite
from .index import IndexEntry, Location, Put
from .segments import RECORD_HEADER_BYTES
from .space import SegmentState

#: Objects up to this size are buffered by ``write`` and written by the commit job.
BUFFERED_BYTES = 256 << 10


@dataclass(slots=True)
class Reservation:
    """``StoreTicket.location`` of this tier: one reserved record range."""

    segment: SegmentState
    offset: int
    record_len: int
    is_writing: bool = False
    is_broken: bool = False  # a write failed or was cancelled: never committable
    buffer: bytearray | None = None  # a small object's bytes, written by the commit
    commit: asyncio.Future | None = None
    is_final: bool = False  # complete_store(True) returned: later calls change nothing

    @property
    def location(self) -> Location:
        return Location(self.segment.number, self.offset, self.record_len, 1)



class DiskStores:
    """``DiskTier``'s store methods (see the module docstring)."""

    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket:
        self._require_started()
        if len(meta.object_id) != 16 or meta.size <= 0 or not 0 <= meta.header_len <= meta.size:
            raise InvalidRequest("an object needs a 16-byte object_id and a positive size")
        if meta.object_id in self._lru or meta.object_id in self._storing:
            raise InvalidRequest(f"object {meta.object_id.hex()} is already stored in the {self.name} tier")
        self._settle_hidden()
        pinned = self._reserved_bytes + self._hidden_bytes + self._leased_bytes()
        if meta.size > self.capacity - pinned:
            raise CapacityError(f"{meta.size} bytes do not fit in the {self.name} tier: "
                                f"{pinned} of {self.capacity} bytes are reserved or leased")
        self._check_free_space(RECORD_HEADER_BYTES + self._body.body_len(meta.size))
        segment, offset = self._space.reserve(RECORD_HEADER_BYTES + self._body.body_len(meta.size),
                                              self._body.header_for(meta.object_id, meta.size))
        ticket = StoreTicket(meta, next(self._ticket_ids),
                             location=Reservation(segment, offset, segment.tail - offset))
        self._tickets[ticket.ticket_id] = ticket
        self._storing.add(meta.object_id)
        self._reserved_bytes += meta.size
        return ticket

    def _check_free_space(self, record_len: int) -> None:
        # statvfs is one metadata syscall (about a microsecond): cheap enough on the loop
        stat = os.statvfs(self.directory)
        free = stat.f_bavail * stat.f_frsize
        if free - record_len < self.free_space_reserve:
            raise CapacityError(f"the disk tier's filesystem has {free} bytes free; {self.free_space_reserve} "
                                f"stay free for its log and index, so deletes keep working")

    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None:
        self._require_started()
        res = self._open_reservation(ticket)
        if res.is_writing:
            raise InvalidRequest("another write of this ticket is in progress")
        try:
            views = [memoryview(chunk).cast("B") for chunk in chunks]
        except TypeError as exc:
            raise InvalidRequest(f"chunks must be contiguous byte buffers: {exc}") from exc
        nbytes = sum(v.nbytes for v in views)
        if ticket.written + nbytes > ticket.meta.size:
            raise InvalidRequest(f"{ticket.written + nbytes} bytes written for a {ticket.meta.size}-byte object")
        if ticket.written == 0 and self._body.cipher is not None and nbytes != ticket.meta.size:
            res.is_broken = True
            raise InvalidRequest("with an at-rest cipher the whole object is written in one call")
        if ticket.meta.size <= BUFFERED_BYTES:
            _copy_into(res, ticket, views)
            return
        res.is_writing = True
        try:
            if ticket.written == 0:
                await self._call(self._body.write_record, res.segment.file, res.offset, ticket.meta.object_id,
                                 ticket.meta.size, views, pins=(res.segment,))
                res.segment.unheaded.pop(res.offset, None)
            else:
                await self._call(self._body.append, res.segment.file, res.offset, ticket.written, views,
                                 pins=(res.segment,))
            ticket.written += nbytes
        except BaseException:
            res.is_broken = True
            raise
        finally:
            res.is_writing = False

    async def complete_store(self, ticket: StoreTicket, success: bool) -> None:
        res = ticket.location
        if not isinstance(res, Reservation):
            raise InvalidRequest(f"not a {self.name} tier ticket")
        if not success:
            await self._abandon(ticket, res)
            return
        self._require_started()
        if res.is_final:
            raise InvalidRequest("this store was already completed")
        if res.commit is None:
            if ticket.ticket_id not in self._tickets:
                raise InvalidRequest("this store was already abandoned")
            if res.is_broken or res.is_writing or ticket.written != ticket.meta.size:
                self._free(ticket)
                raise InvalidRequest(f"{ticket.written} of {ticket.meta.size} bytes written; nothing was stored")
            entry = IndexEntry(res.location, ticket.meta)
            record = None
            if res.buffer is not None:
                record = RecordWrite(res.segment, res.offset, partial(
                    self._body.write_record, res.segment.file, res.offset, ticket.meta.object_id,
                    ticket.meta.size, [memoryview(res.buffer)]))
            res.commit = self._commit.submit(Put(entry), sync=res.segment, record=record,
                                             on_result=partial(self._on_store_result, ticket, entry))
        await asyncio.shield(res.commit)
        res.is_final = True

    def _on_store_result(self, ticket: StoreTicket, entry: IndexEntry, result: object) -> None:
        self._free(ticket)
        if result is True:
            self._space.place(entry.meta.object_id, entry.location)
            self._lru.add(entry.meta)

    async def _abandon(self, ticket: StoreTicket, res: Reservation) -> None:
        if res.is_final:
            return
        if res.commit is None:
            self._free(ticket)
            return
        try:  # complete_store(True) was cancelled or failed: undo whatever it did
            stored = await asyncio.shield(res.commit)
        except StatetierError:
            return
        if stored:
            await self.delete(ticket.meta.object_id)

    def _free(self, ticket: StoreTicket) -> None:
        if self._tickets.pop(ticket.ticket_id, None) is None:
            return
        ticket.location.segment.unpin()
        self._reserved_bytes -= ticket.meta.size
        self._storing.discard(ticket.meta.object_id)

    def _open_reservation(self, ticket: StoreTicket) -> Reservation:
        res = ticket.location
        if not isinstance(res, Reservation) or ticket.ticket_id not in self._tickets:
            raise InvalidRequest("this store ticket is completed or abandoned")
        if res.commit is not None or res.is_broken:
            raise InvalidRequest("this store is completing or has failed")
        return res


def _copy_into(res: Reservation, ticket: StoreTicket, views: list[memoryview]) -> None:
    """Buffer a small object's bytes; the commit job writes them."""
    if res.buffer is None:
        res.buffer = bytearray(ticket.meta.size)
    target = memoryview(res.buffer)
    for view in views:
        target[ticket.written : ticket.written + view.nbytes] = view
        ticket.written += view.nbytes
