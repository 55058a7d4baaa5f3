"""The load path of an extent tier: leases, reads, and frees deferred past the last lease.

- ``ExtentLoads(ledger, region)`` — ``prepare_load`` / ``read`` (``into``: copied into a
  caller's buffer) / ``complete_load`` / ``release_owner`` / ``expire_leases`` of ``ExtentTier``
  (``tiers.memory.extent``), called by the daemon's loads and its maintenance; ``end_all``
  when the tier closes; ``lease_violations`` counts leased objects found moved (a bug).

A lease is granted on ``(offset, generation)``: each use checks the object is still where
the lease found it. Views ``read`` hands out are released at ``complete_load``, so a late
reader fails with ``ValueError`` instead of reading reused space. An object deleted while
leased keeps its extent until its last lease ends (``Ledger.reap``).
"""

from __future__ import annotations

from statetier.protocol.errors import InternalError, InvalidRequest, LeaseError, NotFound

from ..base import Lease
from ..ledger import Ledger
from .rawmemory import exported_for_write, release_quietly
from .records import LeaseState, ObjectExtent
from .region import ExtentRegion


class ExtentLoads:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[ObjectExtent], region: ExtentRegion) -> None:
        self._ledger = ledger
        self._region = region
        self._states: dict[int, LeaseState] = {}
        self.lease_violations = 0

    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease:
        space = self._region.space
        place = space.places.get(object_id)
        meta = self._ledger.index.get(object_id)
        if place is None or meta is None:
            raise NotFound(f"object {object_id.hex()} is not in {self._ledger.name}")
        lease = self._ledger.leases.grant(meta, owner, (place.offset, place.generation), ttl)
        self._states[lease.lease_id] = LeaseState(lease)
        self._ledger.index.touch(object_id)
        space.touch(place)
        return lease

    async def read(self, lease: Lease, *, into: memoryview | None = None, verify: bool = True) -> memoryview:
        """A view of the leased object (nothing is digested here: ``verify`` reads the same),
        or, with ``into``, the object copied into it (writable, at least its size) and that
        part of it returned."""
        place = self._leased_place(lease)
        if into is not None:
            return await self._copy_into(lease, place, into)
        view = await self._region.space.bytes.read_view(self._states[lease.lease_id], place)
        return self._track_view(lease, view)

    async def _copy_into(self, lease: Lease, place: ObjectExtent, dest: memoryview) -> memoryview:
        try:
            with exported_for_write(dest) as (_, room):
                pass
        except (BufferError, TypeError) as exc:
            raise InvalidRequest(f"a read into a buffer needs a writable contiguous one: {exc}") from exc
        if room < place.nbytes:
            raise InvalidRequest(f"destination holds {room} bytes; the object has {place.nbytes}")
        await self._region.space.bytes.copy_to(place, dest)
        self._leased_place(lease)  # still leased: the copy is what the lease pinned
        return dest.cast("B")[: place.nbytes]

    async def complete_load(self, lease: Lease) -> None:
        self.end_lease(lease)

    async def release_owner(self, owner: object) -> int:
        mine = [state.lease for state in self._states.values() if state.lease.owner == owner]
        for lease in mine:
            self.end_lease(lease)
        return len(mine)

    def expire_leases(self) -> int:
        """Drop leases past their deadline (and free what they alone kept); for maintenance.

        ``evict`` and ``compact`` call it first; a lease is also refused on use once late.
        """
        now = self._ledger.leases.now()
        stale = [state.lease for state in self._states.values() if state.lease.deadline < now]
        for lease in stale:
            self._ledger.leases.expired_total += 1
            self.end_lease(lease)
        return len(stale)

    def end_all(self) -> None:
        for state in list(self._states.values()):
            self.end_lease(state.lease)

    def end_lease(self, lease: Lease) -> None:
        self._ledger.leases.release(lease)
        state = self._states.pop(lease.lease_id, None)
        if state is not None:
            for view in state.views:
                release_quietly(view)
            state.keepalive.clear()
        reaped = self._ledger.reap(lease.object_id)
        if reaped is not None:
            self._region.free(reaped[1].offset)

    def _leased_place(self, lease: Lease) -> ObjectExtent:
        space = self._region.space
        try:
            current = self._ledger.leases.check(lease)
        except LeaseError:
            self.end_lease(lease)
            raise
        if current is not lease and current.meta.object_id != lease.meta.object_id:
            raise LeaseError(f"lease {lease.lease_id} does not belong to {self._ledger.name}")
        place = space.places.get(lease.object_id)
        if place is None and self._ledger.is_hidden(lease.object_id):
            place = self._ledger.hidden[lease.object_id][1]
        if place is None or (place.offset, place.generation) != lease.location:
            self.lease_violations += 1
            raise InternalError(f"{self._ledger.name}: leased object {lease.object_id.hex()} moved")
        return place

    def _track_view(self, lease: Lease, view: memoryview) -> memoryview:
        state = self._states.get(lease.lease_id)
        if state is None:  # released while the bytes were being copied
            release_quietly(view)
            raise LeaseError(f"lease {lease.lease_id} ended during the read")
        state.views.append(view)
        return view
