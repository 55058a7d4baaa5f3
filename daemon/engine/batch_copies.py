"""Copies of a batch of objects into one tier, committed together (issue 25: batched commits).

- ``CopyItem(source, meta, chunks)`` — one object to copy: its ``chunks`` (header, payload)
  when they are at hand, else (None) its bytes read from ``source`` under a lease.
- ``copy_all_into(placement, target, items)`` → per item, in order, ``None`` (copied, or
  skipped as ``Placement.copy_between`` skips: a tombstone, the tenant's quota, already
  there) or the ``StatetierError`` that item met. ``daemon.engine.handoff`` publishes a
  batch of puts with it.

One placement cycle for the batch; one eviction for all its bytes; every object written,
then all committed with ``Tier.complete_stores`` (Redis: the chunks that ride with the
commits and one commit script call for the batch, one round trip), instead of a round
trip or two per object. Every ticket is completed (``False`` for those not committed) and
every lease released in ``finally``. Tenant bytes follow each copy as in ``Placement``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from statetier.protocol.errors import CapacityError, InvalidRequest, StatetierError
from statetier.tiers.base import Lease, ObjectMeta, StoreTicket, Tier

from .placement import Placement


@dataclass(frozen=True, slots=True)
class CopyItem:
    source: Tier
    meta: ObjectMeta
    chunks: Sequence | None = None  # None: read from ``source`` under a lease


@dataclass(slots=True)
class _Pending:
    index: int
    item: CopyItem
    chunks: Sequence
    leased: bool
    ticket: StoreTicket | None = None


async def copy_all_into(placement: Placement, target: Tier, items: Sequence[CopyItem]) -> list[StatetierError | None]:
    started = time.perf_counter()
    out: list[StatetierError | None] = [None] * len(items)
    leases: list[tuple[Tier, Lease]] = []
    pending: list[_Pending] = []
    async with placement.cycle():
        try:
            for index, item in enumerate(items):
                chunks = await _bytes_of(placement, target, item, leases, out, index)
                if chunks is not None:
                    pending.append(_Pending(index, item, chunks, item.chunks is None))
            await _prepare(placement, target, pending, out)
            written = [p for p in pending if p.ticket is not None and await _write(target, p, out)]
            tickets = [p.ticket for p in written if p.ticket is not None]  # all: a written copy keeps its ticket
            committed = await target.complete_stores(tickets) if written else []
            seconds = (time.perf_counter() - started) / max(1, len(written))
            for p, error in zip(written, committed):
                p.ticket = None
                out[p.index] = error
                if error is None:
                    await _account(placement, target, p, seconds)
        finally:
            for p in pending:
                if p.ticket is not None:
                    await target.complete_store(p.ticket, False)
            for source, lease in leases:
                await source.complete_load(lease)
    return out


async def _bytes_of(placement: Placement, target: Tier, item: CopyItem, leases: list, out: list,
                    index: int) -> Sequence | None:
    """The item's bytes, or None when it is skipped or failed (said in ``out``)."""
    if item.chunks is not None:
        return item.chunks
    oid = item.meta.object_id
    if placement.is_deleting(oid):
        return None
    try:
        lease = await item.source.prepare_load(oid, owner="copy")
    except StatetierError as exc:
        out[index] = exc
        return None
    leases.append((item.source, lease))
    if not placement.tenancy.may_copy(item.source.name, target.name, oid, lease.meta.size):
        placement.write_behind_skipped += 1
        return None
    try:
        return [await item.source.read(lease)]
    except StatetierError as exc:
        out[index] = exc
        return None


async def _prepare(placement: Placement, target: Tier, pending: list[_Pending], out: list) -> None:
    """A ticket for each pending copy that fits, after one eviction for them all."""
    if not pending:
        return
    await placement.make_room(target, sum(p.item.meta.size for p in pending))
    for p in pending:
        try:
            p.ticket = await target.prepare_store(p.item.meta)
        except InvalidRequest as exc:
            if not p.leased:  # as ``Placement.copy_between``: a copy of an arena object already there is done
                out[p.index] = exc
        except CapacityError as exc:
            out[p.index] = exc


async def _write(target: Tier, p: _Pending, out: list) -> bool:
    ticket = p.ticket
    assert ticket is not None  # written only once prepared: the caller skips a copy without a ticket
    try:
        await target.write(ticket, p.chunks)
        return True
    except StatetierError as exc:
        p.ticket = None
        await target.complete_store(ticket, False)
        out[p.index] = exc
        return False


async def _account(placement: Placement, target: Tier, p: _Pending, seconds: float) -> None:
    """Tenant bytes follow the copy, the store is observed; a copy of an object removed from
    its source while it ran (a damaged copy dropped) must not outlive it, as in
    ``Placement.copy_between``."""
    source, meta = p.item.source, p.item.meta
    oid = meta.object_id
    if placement.metrics is not None:
        placement.metrics.observe_op(target.name, meta.kind.name.lower(), "store", meta.size, seconds)
    placement.tenancy.copied(source.name, target.name, oid)
    if p.leased and not await source.contains(oid):
        await target.delete(oid)
        placement.tenancy.dropped(target.name, oid)
