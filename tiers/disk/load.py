"""The load path of ``DiskTier``: leases, a read-ahead hint, verified reads.

- ``DiskLoads`` — ``prepare_load`` / ``read`` / ``read_into`` / ``complete_load`` /
  ``release_owner`` of ``DiskTier`` (a part ``tiers.disk.tier`` composes; the state it
  uses is declared in ``DiskTier.__init__``), called by the daemon's loads and promotions.

``prepare_load`` asks the kernel to start reading the record (``POSIX_FADV_WILLNEED``);
``read`` preads it, opens its at-rest envelope if it has one and checks its integrity
(``tiers.disk.body``: the header's own lengths, signature, payload digest); ``read_into``
does the same straight into a caller's buffer and returns only once no thread writes there
any more. Damage drops the object for good (``stats().extra["corrupt_dropped"]``) and
raises the rejection; a key id the keyring cannot verify with (``UnknownKey``: another
keyring, not damage) raises and leaves the object; an intact object of another identity is
returned, for the engine.
"""

from __future__ import annotations

import asyncio

from statetier.protocol.classify import is_damage
from statetier.protocol.errors import InternalError, NotFound, RejectedState
from ..base import Lease
from .index import Location
from .space import SegmentState


class DiskLoads:
    """``DiskTier``'s load methods (see the module docstring)."""

    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease:
        self._require_started()
        meta = self._lru.get(object_id)
        if meta is None:
            raise NotFound(f"object {bytes(object_id).hex()} is not in the {self.name} tier")
        location = self._space.location(object_id)
        lease = self._leases.grant(meta, owner, location, ttl)
        self._lru.touch(object_id)
        # a lease is followed by a read (a lookup's leases by the load of what it found):
        # the kernel starts reading the record now, beside whatever runs until then
        self._space.segment_of(location).file.advise_willneed(location.offset, location.record_len)
        return lease

    async def read(self, lease: Lease) -> memoryview:
        lease, location, segment = self._leased_record(lease)
        try:
            blob = await self._call(self._body.read_verified, segment.file, location, lease.object_id,
                                    pins=(segment,))
        except RejectedState as exc:
            if is_damage(exc):
                self._drop_corrupt(lease.object_id)
            raise
        return memoryview(blob)

    async def read_into(self, lease: Lease, dest: memoryview) -> None:
        """``read`` straight into ``dest`` (the object's exact size), verified there. Returns
        only once no thread writes into ``dest`` any more, even when cancelled."""
        lease, location, segment = self._leased_record(lease)
        job = asyncio.ensure_future(self._call(self._body.read_verified_into, segment.file, location,
                                               lease.object_id, dest, pins=(segment,)))
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            while not job.done():  # the thread still writes into dest: the caller may free it only after
                try:
                    await asyncio.wait([job])
                except asyncio.CancelledError:
                    continue
            raise
        except RejectedState as exc:
            if is_damage(exc):
                self._drop_corrupt(lease.object_id)
            raise

    async def complete_load(self, lease: Lease) -> None:
        self._leases.release(lease)
        self._settle_hidden()

    async def release_owner(self, owner: object) -> int:
        released = self._leases.release_owner(owner)
        self._settle_hidden()
        return released

    def _leased_record(self, lease: Lease) -> tuple[Lease, Location, SegmentState]:
        """The lease as the table holds it, where its record lies, and that segment."""
        self._require_started()
        lease = self._leases.check(lease)
        location: Location = lease.location
        segment = self._space.segments.get(location.segment)
        if segment is None:
            raise InternalError(f"segment {location.segment} left while a lease pointed into it")
        return lease, location, segment
