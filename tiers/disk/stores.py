"""The store path of ``DiskTier``: a reserved record range, then a group commit.

- ``DiskStores(ledger, volume, removal)`` — ``prepare_store`` / ``write`` /
  ``complete_store`` of ``DiskTier`` (``tiers.disk.tier``), called by the daemon's
  placement per object, in that order.
- ``RecordReservation`` — ``StoreTicket.location`` of this tier: one reserved record range.
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
from ..ledger import Ledger
from .commit import RecordWrite
from .index import IndexEntry, Location, Put
from .removal import DiskRemoval
from .segments import RECORD_HEADER_BYTES
from .space import SegmentState
from .volume import DiskVolume

#: Objects up to this size are buffered by ``write`` and written by the commit job.
BUFFERED_BYTES = 256 << 10


@dataclass(slots=True)
class RecordReservation:
    """``StoreTicket.location`` of this tier: one reserved record range."""

    segment: SegmentState
    offset: int
    record_len: int
    is_writing: bool = False
    is_broken: bool = False  # a write failed or was cancelled: never committable
    buffer: bytearray | None = None  # a small object's bytes, written by the commit
    commit: asyncio.Future[object] | None = None
    is_final: bool = False  # complete_store(True) returned: later calls change nothing

    @property
    def location(self) -> Location:
        return Location(self.segment.number, self.offset, self.record_len, 1)


class DiskStores:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[Location], volume: DiskVolume, removal: DiskRemoval) -> None:
        self._ledger = ledger
        self._volume = volume
        self._removal = removal
        self._body = volume.body
        self._options = volume.options

    async def prepare_store(self, meta: ObjectMeta) -> StoreTicket:
        volume, ledger, options = self._volume.state, self._ledger, self._options
        if len(meta.object_id) != 16 or meta.size <= 0 or not 0 <= meta.header_len <= meta.size:
            raise InvalidRequest("an object needs a 16-byte object_id and a positive size")
        if meta.object_id in ledger.index or ledger.is_storing(meta.object_id):
            raise InvalidRequest(f"object {meta.object_id.hex()} is already stored in the {ledger.name} tier")
        self._removal.settle()
        pinned = ledger.reserved_bytes + ledger.leases.leased_bytes()
        if meta.size > options.capacity_bytes - pinned:
            raise CapacityError(f"{meta.size} bytes do not fit in the {ledger.name} tier: "
                                f"{pinned} of {options.capacity_bytes} bytes are reserved or leased")
        self._check_free_space(RECORD_HEADER_BYTES + self._body.body_len(meta.size))
        segment, offset = volume.space.reserve(RECORD_HEADER_BYTES + self._body.body_len(meta.size),
                                               self._body.header_for(meta.object_id, meta.size))
        return ledger.open_store(meta, RecordReservation(segment, offset, segment.tail - offset))

    def _check_free_space(self, record_len: int) -> None:
        # statvfs is one metadata syscall (about a microsecond): cheap enough on the loop
        stat = os.statvfs(self._options.directory)
        free = stat.f_bavail * stat.f_frsize
        reserve = self._options.free_space_reserve
        if free - record_len < reserve:
            raise CapacityError(f"the disk tier's filesystem has {free} bytes free; {reserve} "
                                f"stay free for its log and index, so deletes keep working")

    async def write(self, ticket: StoreTicket, chunks: Sequence[Buffer]) -> None:
        volume = self._volume.state
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
                await volume.call(self._body.write_record, res.segment.file, res.offset, ticket.meta.object_id,
                                  ticket.meta.size, views, pins=(res.segment,))
                res.segment.unheaded.pop(res.offset, None)
            else:
                await volume.call(self._body.append, res.segment.file, res.offset, ticket.written, views,
                                  pins=(res.segment,))
            ticket.written += nbytes
        except BaseException:
            res.is_broken = True
            raise
        finally:
            res.is_writing = False

    async def complete_store(self, ticket: StoreTicket, success: bool) -> None:
        res = ticket.location
        if not isinstance(res, RecordReservation):
            raise InvalidRequest(f"not a {self._ledger.name} tier ticket")
        if not success:
            await self._abandon(ticket, res)
            return
        volume = self._volume.state
        if res.is_final:
            raise InvalidRequest("this store was already completed")
        if res.commit is None:
            if not self._ledger.is_open(ticket):
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
            res.commit = volume.commit.submit(Put(entry), sync=res.segment, record=record,
                                              on_result=partial(self._on_store_result, ticket, entry))
        await asyncio.shield(res.commit)
        res.is_final = True

    def _on_store_result(self, ticket: StoreTicket, entry: IndexEntry, result: object) -> None:
        self._free(ticket)
        volume = self._volume.current
        if result is True and volume is not None:
            volume.space.place(entry.meta.object_id, entry.location)
            self._ledger.index.add(entry.meta)

    async def _abandon(self, ticket: StoreTicket, res: RecordReservation) -> None:
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
            await self._removal.delete(ticket.meta.object_id)

    def _free(self, ticket: StoreTicket) -> None:
        if self._ledger.close_store(ticket) and isinstance(ticket.location, RecordReservation):
            ticket.location.segment.unpin()

    def _open_reservation(self, ticket: StoreTicket) -> RecordReservation:
        res = ticket.location
        if not isinstance(res, RecordReservation) or not self._ledger.is_open(ticket):
            raise InvalidRequest("this store ticket is completed or abandoned")
        if res.commit is not None or res.is_broken:
            raise InvalidRequest("this store is completing or has failed")
        return res


def _copy_into(res: RecordReservation, ticket: StoreTicket, views: list[memoryview]) -> None:
    """Buffer a small object's bytes; the commit job writes them."""
    if res.buffer is None:
        res.buffer = bytearray(ticket.meta.size)
    target = memoryview(res.buffer)
    for view in views:
        target[ticket.written : ticket.written + view.nbytes] = view
        ticket.written += view.nbytes
