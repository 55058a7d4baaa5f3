"""A load's promotion under way: the ticket ``Placement.promote`` returns to the load path.

- ``Promotion`` — the reservation ``ticket`` in ``target`` (its ``view`` where the target is
  written in place: the host arena) for the copy leased in ``source``, taken from free room
  inside a placement cycle. The load path (``daemon.engine.serving``) reads the copy into it
  and classifies it there, then ``await complete(ok, owner=, ttl=)`` → the lease on the
  promoted copy, or None when it was not kept: the store completed (``complete_store(ok)``),
  the copy charged to the tenant whose load promoted it, the store and the promotion
  counted, and the cycle ended (a delete waiting for it goes on).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from statetier.tiers.base import Lease, StoreTicket, Tier

from ..metrics import Metrics, NullMetrics
from .cycles import OpenCycle


class Charges(Protocol):
    """What a promotion tells the tenants' books (``daemon.engine.tenancy.Tenancy``)."""

    def charge(self, tenant: str, tier: str, object_id: bytes, nbytes: int) -> None: ...


@dataclass(slots=True)
class Promotion:
    """See the module docstring."""

    source: Tier
    target: Tier
    ticket: StoreTicket
    tenant: str
    tenancy: Charges
    metrics: Metrics | NullMetrics
    cycle: OpenCycle
    started: float = field(default_factory=time.perf_counter)

    async def complete(self, ok: bool, *, owner: object, ttl: float | None) -> Lease | None:
        """The store completed (visible only when ``ok``), then charged, counted and leased."""
        target, meta = self.target, self.ticket.meta
        try:
            await target.complete_store(self.ticket, ok)
            if not ok:
                return None
            self.tenancy.charge(self.tenant, target.name, meta.object_id, meta.size)
            self.metrics.observe_op(target.name, meta.kind.name.lower(), "store", meta.size,
                                    time.perf_counter() - self.started)
            self.metrics.count_promotion(self.source.name, target.name)
            return await target.prepare_load(meta.object_id, owner=owner, ttl=ttl)
        finally:
            await self.cycle.end()
