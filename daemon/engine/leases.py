"""Leases the engine holds for its callers: one tier lease each, known to its owner.

- ``Held``                         — a tier, the tier's lease, the owner (a connection)
- ``Leases(ids)``                  — the engine's table; ``ids`` the engine's one counter
  (one id names one lease, never reused)
  - ``hold(tier, lease, owner)`` → ``(lease_id, Held)``: a load's result or a lookup's
    object (``daemon.engine.loads``, ``daemon.engine.serving``, ``daemon.engine.lookup``: each
    is handed this table), kept until released
  - ``release(lease_id, owner)`` → bool; ``release_many(lease_ids, owner)`` → how many;
    ``ids_of(owner)``, ``owners()``, ``len()``
  - ``held_by(lease_id, owner)`` → ``Held``, or ``LeaseError`` for another owner's id
  - ``asked`` (lease ids asked to be released) and ``released`` (tier leases completed):
    each grows by one per load, whoever gives its lease back (tests count them)

Releasing completes the tier lease (``Tier.complete_load``): the object may move again.
"""

from __future__ import annotations

from dataclasses import dataclass

from statetier.protocol.errors import LeaseError
from statetier.tiers.base import Lease, Tier


@dataclass(slots=True)
class Held:
    """An engine lease: one tier lease, known to its owner (a connection)."""

    tier: Tier
    lease: Lease
    owner: object


class Leases:
    def __init__(self, ids) -> None:
        self._ids = ids
        self._held: dict[int, Held] = {}
        self.asked = 0
        self.released = 0

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, tier: Tier, lease: Lease, owner) -> tuple[int, Held]:
        lease_id = next(self._ids)
        held = Held(tier, lease, owner)
        self._held[lease_id] = held
        return lease_id, held

    async def release(self, lease_id: int, owner) -> bool:
        self.asked += 1
        held = self._held.get(lease_id)
        if held is None or held.owner != owner:
            return False
        del self._held[lease_id]
        self.released += 1
        await held.tier.complete_load(held.lease)
        return True

    async def release_many(self, lease_ids: list[int], owner) -> int:
        held = []
        self.asked += len(lease_ids)
        for lease_id in lease_ids:
            found = self._held.get(lease_id)
            if found is not None and found.owner == owner:
                del self._held[lease_id]
                held.append(found)
        self.released += len(held)
        for found in held:
            await found.tier.complete_load(found.lease)
        return len(held)

    def ids_of(self, owner) -> list[int]:
        return [lid for lid, held in self._held.items() if held.owner == owner]

    def owners(self) -> set:
        return {held.owner for held in self._held.values()}

    def held_by(self, lease_id: int, owner) -> Held:
        held = self._held.get(lease_id)
        if held is None or held.owner != owner:
            raise LeaseError(f"no lease {lease_id} on this connection")
        return held
