"""A load's promotion under way: the ticket ``Placement.promote`` returns to the load path.

- ``Promotion`` — a ``daemon.engine.tier_copies.TierCopy`` (the reservation ``ticket`` in
  ``target``, its ``view`` where the target is written in place: the host arena, taken from
  free room and charged to the tenant whose load promoted it) of the copy leased in
  ``source``, inside a placement cycle. The load path (``daemon.engine.serving``) reads the
  copy into it and classifies it there, then ``await complete(ok, owner=, ttl=)`` → the
  lease on the promoted copy, or None when it was not kept: the copy completed
  (``TierCopy.complete``: the store, its charge and count, once) and the cycle ended (a delete
  waiting for it goes on).
"""

from __future__ import annotations

from dataclasses import dataclass

from statetier.tiers.base import Lease, StoreTicket, Tier

from .cycles import OpenCycle
from .tier_copies import TierCopy


@dataclass(slots=True)
class Promotion:
    """See the module docstring."""

    copy: TierCopy
    cycle: OpenCycle

    @property
    def source(self) -> Tier:
        return self.copy.source

    @property
    def target(self) -> Tier:
        return self.copy.target

    @property
    def ticket(self) -> StoreTicket:
        return self.copy.ticket

    async def complete(self, ok: bool, *, owner: object, ttl: float | None) -> Lease | None:
        """The copy completed (visible, charged and counted only when ``ok``), then leased."""
        try:
            if not await self.copy.complete(ok):
                return None
            return await self.target.prepare_load(self.ticket.meta.object_id, owner=owner, ttl=ttl)
        finally:
            await self.cycle.end()
