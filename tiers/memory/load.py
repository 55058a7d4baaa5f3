"""The load path of ``ExtentTier``: leases, reads, and frees deferred past the last lease.

- ``ExtentLoads`` — ``prepare_load`` / ``read`` / ``read_into`` / ``complete_load`` /
  ``release_owner`` / ``expire_leases`` of ``ExtentTier`` (a part ``tiers.memory.extent``
  composes; the state it uses is declared in ``ExtentTier.__init__``), called by the
  daemon's loads and its maintenance.

A lease is granted on ``(offset, generation)``: each use checks the object is still where
the lease found it (a move under a lease is a bug, counted in ``lease_violations``). Views
``read`` hands out are released at ``complete_load``, so a late reader fails with
``ValueError`` instead of reading reused space. An object deleted while leased keeps its
extent until its last lease ends (``_maybe_reap``).
"""

from __future__ import annotations

import time

from statetier.protocol.errors import InternalError, InvalidRequest, LeaseError, NotFound

from ..base import Buffer, Lease
from .placement import LeaseState, Placement
from .rawmemory import exported_for_write, release_quietly


class ExtentLoads:
    """``ExtentTier``'s load methods (see the module docstring)."""

    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease:
        self._require_open()
        placement = self._places.get(object_id)
        if placement is None:
            raise NotFound(f"object {object_id.hex()} is not in {self.name}")
        lease = self._leases.grant(self._index.get(object_id), owner, (placement.offset, placement.generation), ttl)
        self._lease_states[lease.lease_id] = LeaseState(lease)
        self._index.touch(object_id)
        placement.touched = next(self._touches)
        return lease

    async def read(self, lease: Lease) -> memoryview:
        placement = self._leased_placement(lease)
        view = await self._read_view(self._lease_states[lease.lease_id], placement)
        return self._track_view(lease, view)

    async def read_into(self, lease: Lease, dest: Buffer) -> int:
        """Copy the leased object into ``dest`` (writable, at least its size); returns the size."""
        placement = self._leased_placement(lease)
        try:
            with exported_for_write(dest) as (_, room):
                pass
        except (BufferError, TypeError) as exc:
            raise InvalidRequest(f"read_into needs a writable contiguous buffer: {exc}") from exc
        if room < placement.nbytes:
            raise InvalidRequest(f"destination holds {room} bytes; the object has {placement.nbytes}")
        await self._copy_to(placement, dest)
        self._leased_placement(lease)  # still leased: the copy is what the lease pinned
        return placement.nbytes

    async def complete_load(self, lease: Lease) -> None:
        self._end_lease(lease)

    async def release_owner(self, owner: object) -> int:
        mine = [state.lease for state in self._lease_states.values() if state.lease.owner == owner]
        for lease in mine:
            self._end_lease(lease)
        return len(mine)

    def _leased_placement(self, lease: Lease) -> Placement:
        self._require_open()
        try:
            current = self._leases.check(lease)
        except LeaseError:
            self._end_lease(lease)
            raise
        if current is not lease and current.meta.object_id != lease.meta.object_id:
            raise LeaseError(f"lease {lease.lease_id} does not belong to {self.name}")
        placement = self._places.get(lease.object_id)
        if placement is None and lease.object_id in self._hidden:
            placement = self._hidden[lease.object_id][1]
        if placement is None or (placement.offset, placement.generation) != lease.location:
            self.lease_violations += 1
            raise InternalError(f"{self.name}: leased object {lease.object_id.hex()} moved")
        return placement

    def _track_view(self, lease: Lease, view: memoryview) -> memoryview:
        state = self._lease_states.get(lease.lease_id)
        if state is None:  # released while the bytes were being copied
            release_quietly(view)
            raise LeaseError(f"lease {lease.lease_id} ended during the read")
        state.views.append(view)
        return view

    def _end_lease(self, lease: Lease) -> None:
        self._leases.release(lease)
        state = self._lease_states.pop(lease.lease_id, None)
        if state is not None:
            for view in state.views:
                release_quietly(view)
            state.keepalive.clear()
        self._maybe_reap(lease.object_id)

    def expire_leases(self) -> int:
        """Drop leases past their deadline (and free what they alone kept); for maintenance.

        ``evict`` and ``compact`` call it first; a lease is also refused on use once late.
        """
        now = time.monotonic()
        stale = [state.lease for state in self._lease_states.values() if state.lease.deadline < now]
        for lease in stale:
            self._leases.expired_total += 1
            self._end_lease(lease)
        return len(stale)

    def _maybe_reap(self, object_id: bytes) -> None:
        if object_id in self._hidden and not self._leases.is_leased(object_id):
            meta, placement = self._hidden.pop(object_id)
            self._hidden_bytes -= meta.size
            self._free_extent(placement.offset)
