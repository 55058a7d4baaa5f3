"""One copy of an object from one tier into another: the room it takes and who pays for it.

Every tier-to-tier copy the daemon makes — a load's promotion, the write-behind worker's
copies and deferred promotions, an eviction's demotions, a batch's publish copies — is one
``Placement.begin_copy(source, target, meta, room=, charge=)`` → ``TierCopy``, written, then
``TierCopy.complete(ok)`` (or, for a batch committed with ``Tier.complete_stores``,
``TierCopy.committed(seconds)``). ``Placement.copy_object`` does all three for bytes at hand.

- ``Room`` — ``FREE`` (the target's free room only: a load never evicts) or ``EVICT`` (room
  made by the target's watermarks, evicting and demoting, as a put does).
- ``Charge`` — who pays for the copy's bytes in the target, asked before the reservation
  (``allows``) and booked once the copy is visible (``book``):
  ``FOLLOWS`` (the source copy's tenant, within its quota there: write-behind, a leased
  copy's publish), ``REQUIRED`` (the same, whatever the quota: a put's own publish or
  durable copy of bytes at hand), ``MOVES`` (the
  same, refunded in the source: a demotion, counted as one) and ``ChargedTo(tenant)`` (the
  tenant whose load promoted it, counted as a promotion).
- ``TierCopy`` — the reservation in the target (``ticket``; its ``view`` where the target is
  written in place) and the charge to book; ``complete(ok)`` completes the store, books
  the charge and observes the store, once.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from statetier.tiers.base import ObjectMeta, StoreTicket, Tier

from ..metrics import Metrics, NullMetrics


class Room(enum.Enum):
    FREE = "free"
    EVICT = "evict"


class Books(Protocol):
    """The tenants' books a copy is charged in (``daemon.engine.tenancy.Tenancy``)."""

    def may_copy(self, src: str, dst: str, object_id: bytes, nbytes: int) -> bool: ...

    def would_exceed(self, tenant: str, tier: str, nbytes: int) -> bool: ...

    def charge(self, tenant: str, tier: str, object_id: bytes, nbytes: int) -> None: ...

    def copied(self, src: str, dst: str, object_id: bytes) -> None: ...

    def moved(self, src: str, dst: str, object_id: bytes) -> None: ...


class Charge(Protocol):
    @property
    def name(self) -> str: ...

    def allows(self, books: Books, src: str, dst: str, meta: ObjectMeta) -> bool: ...

    def book(self, books: Books, metrics: Metrics | NullMetrics, src: str, dst: str, meta: ObjectMeta) -> None: ...


@dataclass(frozen=True, slots=True)
class _Follows:
    """The source copy's tenant pays in the target too (a copy: both copies stay)."""

    name: str = "copy"

    def allows(self, books: Books, src: str, dst: str, meta: ObjectMeta) -> bool:
        return books.may_copy(src, dst, meta.object_id, meta.size)

    def book(self, books: Books, metrics: Metrics | NullMetrics, src: str, dst: str, meta: ObjectMeta) -> None:
        books.copied(src, dst, meta.object_id)


@dataclass(frozen=True, slots=True)
class _Required:
    """The source copy's tenant pays in the target, whatever its quota there: a copy the put
    asked for (publish, durable), of the bytes at hand."""

    name: str = "required"

    def allows(self, books: Books, src: str, dst: str, meta: ObjectMeta) -> bool:
        return True

    def book(self, books: Books, metrics: Metrics | NullMetrics, src: str, dst: str, meta: ObjectMeta) -> None:
        books.copied(src, dst, meta.object_id)


@dataclass(frozen=True, slots=True)
class _Moves:
    """The source copy's tenant pays in the target and is refunded in the source (a demotion)."""

    name: str = "demotion"

    def allows(self, books: Books, src: str, dst: str, meta: ObjectMeta) -> bool:
        return books.may_copy(src, dst, meta.object_id, meta.size)

    def book(self, books: Books, metrics: Metrics | NullMetrics, src: str, dst: str, meta: ObjectMeta) -> None:
        books.moved(src, dst, meta.object_id)
        metrics.count_demotion(src, dst)


@dataclass(frozen=True, slots=True)
class ChargedTo:
    """``tenant`` (whose load asked for it) pays in the target: a promotion."""

    tenant: str
    name: str = "promotion"

    def allows(self, books: Books, src: str, dst: str, meta: ObjectMeta) -> bool:
        return not books.would_exceed(self.tenant, dst, meta.size)

    def book(self, books: Books, metrics: Metrics | NullMetrics, src: str, dst: str, meta: ObjectMeta) -> None:
        books.charge(self.tenant, dst, meta.object_id, meta.size)
        metrics.count_promotion(src, dst)


FOLLOWS: Charge = _Follows()
REQUIRED: Charge = _Required()
MOVES: Charge = _Moves()


@dataclass(slots=True)
class TierCopy:
    """See the module docstring."""

    source: Tier
    target: Tier
    ticket: StoreTicket
    charge: Charge
    books: Books
    metrics: Metrics | NullMetrics
    started: float = field(default_factory=time.perf_counter)

    async def complete(self, ok: bool) -> bool:
        """The store completed (visible only when ``ok``), then booked; ``ok`` back."""
        await self.target.complete_store(self.ticket, ok)
        if ok:
            self.committed(time.perf_counter() - self.started)
        return ok

    def committed(self, seconds: float) -> None:
        """The store is visible (completed here, or with a batch's ``complete_stores``):
        the charge booked and the store observed."""
        meta = self.ticket.meta
        self.charge.book(self.books, self.metrics, self.source.name, self.target.name, meta)
        self.metrics.observe_op(self.target.name, meta.kind.name.lower(), "store", meta.size, seconds)
