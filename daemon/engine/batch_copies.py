"""Copies of a batch of objects into one tier, committed together (issue 25: batched commits).

- ``CopyItem(source, meta, chunks)`` — one object to copy: its ``chunks`` (header, payload)
  when they are at hand (a put's own copy: ``tier_copies.REQUIRED``), else (None) its bytes
  read from ``source`` under a lease (within the tenant's quota: ``tier_copies.FOLLOWS``).
- ``copy_all_into(placement, target, items)`` → per item, in order, ``None`` (copied, or
  skipped as ``Placement.copy_between`` skips: a tombstone, the tenant's quota, already
  there) or the ``StatetierError`` that item met. ``daemon.engine.handoff`` publishes a
  batch of puts with it.

One placement cycle for the batch; one eviction for all its bytes; each copy begun with
``Placement.begin_copy`` (free room, after that eviction), written, then all committed with
``Tier.complete_stores`` (Redis: the chunks that ride with the commits and one commit script
call for the batch, one round trip), instead of a round trip or two per object, and each
``TierCopy.committed`` (tenant bytes follow it, the store observed). Every reservation is
completed (``False`` for those not committed) and every lease released in ``finally``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from statetier.protocol.errors import CapacityError, InvalidRequest, StatetierError
from statetier.tiers.base import Lease, ObjectMeta, Tier

from .placement import Placement
from .tier_copies import FOLLOWS, REQUIRED, TierCopy, Room


@dataclass(frozen=True, slots=True)
class CopyItem:
    source: Tier
    meta: ObjectMeta
    chunks: Sequence | None = None  # None: read from ``source`` under a lease


@dataclass(slots=True)
class _Pending:
    index: int
    item: CopyItem
    lease: Lease | None  # the source lease its bytes are read under; None: ``item.chunks``
    copy: TierCopy | None = None


async def copy_all_into(placement: Placement, target: Tier, items: Sequence[CopyItem]) -> list[StatetierError | None]:
    started = time.perf_counter()
    out: list[StatetierError | None] = [None] * len(items)
    pending: list[_Pending] = []
    async with placement.cycle():
        try:
            for index, item in enumerate(items):
                p = await _leased(placement, item, index, out)
                if p is not None:
                    pending.append(p)
            await _begin(placement, target, pending, out)
            written = [p for p in pending if p.copy is not None and await _write(target, p, out)]
            copies = [p.copy for p in written if p.copy is not None]  # all: a written copy keeps its reservation
            committed = await target.complete_stores([c.ticket for c in copies]) if copies else []
            seconds = (time.perf_counter() - started) / max(1, len(written))
            for p, copy, error in zip(written, copies, committed):
                p.copy = None
                out[p.index] = error
                if error is None:
                    copy.committed(seconds)
                    if p.lease is not None:
                        await placement.undo_if_source_lost(p.item.source, target, p.item.meta.object_id)
        finally:
            for p in pending:
                if p.copy is not None:
                    await target.complete_store(p.copy.ticket, False)
                if p.lease is not None:
                    await p.item.source.complete_load(p.lease)
    return out


async def _leased(placement: Placement, item: CopyItem, index: int, out: list) -> _Pending | None:
    """The item to copy (under a source lease when its bytes are not at hand), or None when
    it is skipped or failed (said in ``out``)."""
    if item.chunks is not None:
        return _Pending(index, item, None)
    oid = item.meta.object_id
    if placement.is_deleting(oid):
        return None
    try:
        return _Pending(index, item, await item.source.prepare_load(oid, owner="copy"))
    except StatetierError as exc:
        out[index] = exc
        return None


async def _begin(placement: Placement, target: Tier, pending: list[_Pending], out: list) -> None:
    """A copy begun for each pending item that fits, after one eviction for them all."""
    if not pending:
        return
    await placement.make_room(target, sum(p.item.meta.size for p in pending))
    for p in pending:
        source, meta = p.item.source, p.item.meta
        charge = FOLLOWS if p.lease is not None else REQUIRED
        try:
            p.copy = await placement.begin_copy(source, target, meta, room=Room.FREE, charge=charge)
            if p.copy is None:
                placement.write_behind_skipped += 1  # over the tenant's quota there
        except InvalidRequest as exc:
            if p.lease is None:  # as ``Placement.copy_between``: a copy of an arena object already there is done
                out[p.index] = exc
        except CapacityError as exc:
            out[p.index] = exc


async def _write(target: Tier, p: _Pending, out: list) -> bool:
    copy = p.copy
    assert copy is not None  # written only once begun: the caller skips a copy without one
    try:
        if p.lease is not None:
            chunks: Sequence = [await p.item.source.read(p.lease)]
        else:
            assert p.item.chunks is not None  # not leased: its bytes are at hand
            chunks = p.item.chunks
        await target.write(copy.ticket, chunks)
        return True
    except StatetierError as exc:
        p.copy = None
        await target.complete_store(copy.ticket, False)
        out[p.index] = exc
        return False
