"""The load path of ``DiskTier``: leases, a read-ahead hint, verified reads.

- ``DiskLoads(ledger, volume, removal)`` — ``prepare_load`` / ``read`` / ``complete_load`` /
  ``release_owner`` of ``DiskTier`` (``tiers.disk.tier``), called by the daemon's loads and
  promotions; ``read(verify=False)`` without the pass over the payload, for a load whose
  client verifies it where it lands.

``prepare_load`` asks the kernel to start reading the record (``POSIX_FADV_WILLNEED``);
``read`` preads it, opens its at-rest envelope if it has one and checks its integrity
(``tiers.disk.body``: the header's own lengths, signature, payload digest); with ``into`` it
does the same straight into a caller's buffer and returns only once no thread writes there
any more. Damage drops the object for good (``stats().extra["corrupt_dropped"]``) and
raises the rejection; a key id the keyring cannot verify with (``UnknownKey``: another
keyring, not damage) raises and leaves the object; an intact object of another identity is
returned, for the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from statetier.protocol.cancellation import wait_out_cancellation
from statetier.protocol.classify import is_damage
from statetier.protocol.errors import InternalError, NotFound, RejectedState

from ..base import Lease
from ..ledger import Ledger
from .index import Location
from .removal import DiskRemoval
from .segments import SegmentFile
from .space import SegmentState
from .volume import DiskVolume, OpenVolume

#: ``DiskBody.read_verified`` / ``read_signed``: (file, location, object id) → the sealed bytes
_ReadBody = Callable[[SegmentFile, Location, bytes], bytes | bytearray]
#: ``DiskBody.read_verified_into`` / ``read_signed_into``: the same into ``dest``
_ReadBodyInto = Callable[[SegmentFile, Location, bytes, memoryview], None]


class DiskLoads:
    """See the module docstring."""

    def __init__(self, ledger: Ledger[Location], volume: DiskVolume, removal: DiskRemoval) -> None:
        self._ledger = ledger
        self._volume = volume
        self._removal = removal
        self._body = volume.body

    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease:
        space = self._volume.state.space
        meta = self._ledger.index.get(object_id)
        location = space.location(object_id)
        if meta is None or location is None:
            raise NotFound(f"object {bytes(object_id).hex()} is not in the {self._ledger.name} tier")
        lease = self._ledger.leases.grant(meta, owner, location, ttl)
        self._ledger.index.touch(object_id)
        # a lease is followed by a read (a lookup's leases by the load of what it found):
        # the kernel starts reading the record now, beside whatever runs until then
        space.segment_of(location).file.advise_willneed(location.offset, location.record_len)
        return lease

    async def read(self, lease: Lease, *, into: memoryview | None = None, verify: bool = True) -> memoryview:
        """The record's sealed object, its integrity checked (without the pass over the
        payload unless ``verify``); with ``into`` (the object's exact size) read straight
        into it, returning only once no thread writes there any more, even when cancelled."""
        body = self._body
        if into is None:
            return await self._read(lease, body.read_verified if verify else body.read_signed)
        await self._read_into(lease, into, body.read_verified_into if verify else body.read_signed_into)
        return into

    async def _read(self, lease: Lease, read_body: _ReadBody) -> memoryview:
        volume, lease, location, segment = self._leased_record(lease)
        try:
            blob = await volume.call(read_body, segment.file, location, lease.object_id, pins=(segment,))
        except RejectedState as exc:
            if is_damage(exc):
                self._removal.drop_corrupt(lease.object_id)
            raise
        return memoryview(blob)

    async def _read_into(self, lease: Lease, dest: memoryview, read_body_into: _ReadBodyInto) -> None:
        volume, lease, location, segment = self._leased_record(lease)
        job = asyncio.ensure_future(volume.call(read_body_into, segment.file, location, lease.object_id, dest,
                                                pins=(segment,)))
        try:
            await wait_out_cancellation(job)  # the thread writes into dest: the caller frees it only after
        except RejectedState as exc:
            if is_damage(exc):
                self._removal.drop_corrupt(lease.object_id)
            raise

    async def complete_load(self, lease: Lease) -> None:
        self._ledger.leases.release(lease)
        self._removal.settle()

    async def release_owner(self, owner: object) -> int:
        released = self._ledger.leases.release_owner(owner)
        self._removal.settle()
        return released

    def _leased_record(self, lease: Lease) -> tuple[OpenVolume, Lease, Location, SegmentState]:
        """The open volume, the lease as the table holds it, where its record lies, and that segment."""
        volume = self._volume.state
        lease = self._ledger.leases.check(lease)
        location = lease.location
        if not isinstance(location, Location):
            raise InternalError(f"lease {lease.lease_id} is not a {self._ledger.name} tier lease")
        segment = volume.space.segments.get(location.segment)
        if segment is None:
            raise InternalError(f"segment {location.segment} left while a lease pointed into it")
        return volume, lease, location, segment
