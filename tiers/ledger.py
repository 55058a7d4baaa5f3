"""The bookkeeping of one tier: what it holds, leases, is storing, and deleted under a lease.

- ``Ledger[P]`` — one per tier, made by the tier and handed to each of its parts (stores,
  loads, removal, compaction), which keep no bookkeeping of their own. ``P`` is what the
  tier records of where an object's bytes are (an arena extent, a segment location, a Redis
  manifest). It holds:
  - ``index`` — the visible objects this process holds, in LRU order and by key digest
    (``LruIndex``; the memory and disk tiers: the Redis tier's objects are in Redis);
  - ``leases`` — the ``LeaseTable``;
  - the stores in progress: ``open_store`` / ``is_open`` / ``close_store`` (tickets by id,
    the ids being stored, the bytes they reserve);
  - the objects deleted while leased: ``hide``, then ``reap`` / ``reap_all`` hand back
    those whose last lease ended, for the tier to free their bytes;
  - ``evictions`` and ``corrupt_dropped``, the counters every tier reports.
- ``LeaseTable`` — leases by id, by object and by owner, with deadlines on the tier's
  ``Clock`` (``now()``; ``time.monotonic`` unless the tier's options name another).
- ``LruIndex`` — object metadata by id and by key digest, in the order its eviction policy
  keeps (``tiers.eviction``: ``LruPolicy`` unless the tier hands the ``Ledger`` another).

Bookkeeping runs on the event loop only: nothing here awaits or blocks.
"""

from __future__ import annotations

import itertools
import time
from typing import Generic, TypeVar

from statetier.protocol.errors import LeaseError

from .base import Clock, Lease, ObjectMeta, StoreTicket
from .eviction import EvictionPolicy, LruPolicy

P = TypeVar("P")


class Ledger(Generic[P]):
    """See the module docstring."""

    def __init__(self, name: str, lease_ttl: float, clock: Clock = time.monotonic,
                 policy: EvictionPolicy | None = None) -> None:
        self.name = name
        self.index = LruIndex(policy)
        self.leases = LeaseTable(lease_ttl, clock)
        self.stores: dict[int, StoreTicket] = {}  # in progress, by ticket id
        self.reserved_bytes = 0  # what the stores in progress will hold
        self.hidden: dict[bytes, tuple[ObjectMeta, P]] = {}  # deleted while leased
        self.hidden_bytes = 0
        self.evictions = 0
        self.corrupt_dropped = 0  # copies found damaged and removed
        self._storing: set[bytes] = set()
        self._ticket_ids = itertools.count(1)

    # ------------------------------------------------------------------ stores in progress

    def open_store(self, meta: ObjectMeta, location: object, view: memoryview | None = None) -> StoreTicket:
        ticket = StoreTicket(meta, next(self._ticket_ids), view=view, location=location)
        self.stores[ticket.ticket_id] = ticket
        self._storing.add(meta.object_id)
        self.reserved_bytes += meta.size
        return ticket

    def is_open(self, ticket: StoreTicket) -> bool:
        return self.stores.get(ticket.ticket_id) is ticket

    def close_store(self, ticket: StoreTicket) -> bool:
        """End a store in progress (stored or not, the caller decides); False when it was
        not open (completed before, or never this tier's)."""
        if self.stores.get(ticket.ticket_id) is not ticket:
            return False
        del self.stores[ticket.ticket_id]
        self._storing.discard(ticket.meta.object_id)
        self.reserved_bytes -= ticket.meta.size
        return True

    def is_storing(self, object_id: bytes) -> bool:
        return object_id in self._storing

    def close_all_stores(self) -> list[StoreTicket]:
        """Forget every store in progress (the tier is closing); returns them."""
        tickets = list(self.stores.values())
        self.stores.clear()
        self._storing.clear()
        self.reserved_bytes = 0
        return tickets

    # ------------------------------------------------------------------ deleted while leased

    def hide(self, meta: ObjectMeta, place: P) -> None:
        """``meta`` was deleted while leased: its bytes stay until its last lease ends."""
        self.hidden[meta.object_id] = (meta, place)
        self.hidden_bytes += meta.size

    def is_hidden(self, object_id: bytes) -> bool:
        return object_id in self.hidden

    def reap(self, object_id: bytes) -> tuple[ObjectMeta, P] | None:
        """The hidden object ``object_id`` if no lease holds it any more (forgotten now)."""
        if object_id not in self.hidden or self.leases.is_leased(object_id):
            return None
        meta, place = self.hidden.pop(object_id)
        self.hidden_bytes -= meta.size
        return meta, place

    def reap_all(self) -> list[tuple[ObjectMeta, P]]:
        """Every hidden object no lease holds any more (forgotten now)."""
        free = [oid for oid in self.hidden if not self.leases.is_leased(oid)]
        reaped = [self.hidden.pop(oid) for oid in free]
        self.hidden_bytes -= sum(meta.size for meta, _ in reaped)
        return reaped

    # ------------------------------------------------------------------ totals

    @property
    def held_bytes(self) -> int:
        """Object bytes stored: visible, and deleted but leased."""
        return self.index.bytes_used + self.hidden_bytes

    @property
    def bytes_used(self) -> int:
        """``held_bytes`` and what the stores in progress reserve."""
        return self.index.bytes_used + self.hidden_bytes + self.reserved_bytes

    def forget_all(self) -> None:
        """Drop what the index, the stores and the hidden objects hold (the tier closed)."""
        self.index = LruIndex()
        self.close_all_stores()
        self.hidden.clear()
        self.hidden_bytes = 0


class LeaseTable:
    """Leases of one tier: by id, by object, by owner; with deadlines.

    ``is_leased(object_id)`` is what compaction and eviction consult. Expired leases are
    dropped by ``expire()`` (called from the tier's maintenance and before compaction);
    using an expired or released lease raises ``LeaseError``.
    """

    def __init__(self, default_ttl: float = 30.0, clock: Clock = time.monotonic) -> None:
        self.default_ttl = default_ttl
        self._clock = clock
        self._ids = itertools.count(1)
        self._leases: dict[int, Lease] = {}
        self._by_object: dict[bytes, set[int]] = {}
        self._earliest = float("inf")  # no lease has an earlier deadline (releases may leave it lower)
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def now(self) -> float:
        """The time on the clock deadlines are set and checked on."""
        return self._clock()

    def grant(self, meta: ObjectMeta, owner: object, location: object = None, ttl: float | None = None) -> Lease:
        lease = Lease(next(self._ids), meta, owner, self._clock() + (ttl or self.default_ttl), location)
        self._leases[lease.lease_id] = lease
        self._earliest = min(self._earliest, lease.deadline)
        self._by_object.setdefault(meta.object_id, set()).add(lease.lease_id)
        return lease

    def check(self, lease: Lease) -> Lease:
        current = self._leases.get(lease.lease_id)
        if current is None:
            raise LeaseError(f"lease {lease.lease_id} was released or expired")
        if current.deadline < self._clock():
            self.release(lease)
            self.expired_total += 1
            raise LeaseError(f"lease {lease.lease_id} passed its deadline")
        return current

    def release(self, lease: Lease) -> bool:
        if self._leases.pop(lease.lease_id, None) is None:
            return False
        ids = self._by_object.get(lease.meta.object_id)
        if ids is not None:
            ids.discard(lease.lease_id)
            if not ids:
                del self._by_object[lease.meta.object_id]
        return True

    def release_owner(self, owner: object) -> int:
        mine = [lease for lease in self._leases.values() if lease.owner == owner]
        for lease in mine:
            self.release(lease)
        return len(mine)

    def expire(self, now: float | None = None) -> int:
        now = self._clock() if now is None else now
        if now <= self._earliest:  # nothing to sweep: called before every lease, keep it O(1)
            return 0
        stale = [lease for lease in self._leases.values() if lease.deadline < now]
        for lease in stale:
            self.release(lease)
        self._earliest = min((lease.deadline for lease in self._leases.values()), default=float("inf"))
        self.expired_total += len(stale)
        return len(stale)

    def is_leased(self, object_id: bytes) -> bool:
        return object_id in self._by_object

    def leased_bytes(self) -> int:
        """The sizes of the objects under a lease, each counted once."""
        return sum(self._leases[next(iter(ids))].meta.size for ids in self._by_object.values())


class LruIndex:
    """Object metadata by id and by key digest, in the order of its eviction policy
    (least recently used first, unless the tier chose another)."""

    def __init__(self, policy: EvictionPolicy | None = None) -> None:
        self._policy: EvictionPolicy = policy if policy is not None else LruPolicy()
        self._objects: dict[bytes, ObjectMeta] = {}
        self._by_key: dict[bytes, dict[bytes, ObjectMeta]] = {}
        self.bytes_used = 0

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, object_id: bytes) -> bool:
        return object_id in self._objects

    def get(self, object_id: bytes) -> ObjectMeta | None:
        return self._objects.get(object_id)

    def add(self, meta: ObjectMeta) -> None:
        self.remove(meta.object_id)
        self._objects[meta.object_id] = meta
        self._policy.added(meta)
        self._by_key.setdefault(meta.key_digest, {})[meta.object_id] = meta
        self.bytes_used += meta.size

    def remove(self, object_id: bytes) -> ObjectMeta | None:
        meta = self._objects.pop(object_id, None)
        if meta is None:
            return None
        self._policy.removed(object_id)
        by_key = self._by_key.get(meta.key_digest)
        if by_key is not None:
            by_key.pop(object_id, None)
            if not by_key:
                del self._by_key[meta.key_digest]
        self.bytes_used -= meta.size
        return meta

    def touch(self, object_id: bytes) -> None:
        self._policy.touched(object_id)

    def by_key(self, key_digest: bytes) -> list[ObjectMeta]:
        return list(self._by_key.get(key_digest, {}).values())

    def lru_order(self) -> list[ObjectMeta]:
        """The objects, the first to evict first (the policy's order)."""
        return self._policy.order()
