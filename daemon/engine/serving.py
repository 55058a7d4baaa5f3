"""Serving one leased copy: classify it, promote it when it came from below, hold it.

- ``Wanted``                      — what one load asks of every copy it tries: the state_id,
                                    the ``Expectation``, the owner, the tenant, ``full_check``,
                                    the deletes ended before it began (``delete_mark``);
                                    copies are classified against ``judged`` (the tensor specs
                                    are checked apart, by ``daemon.engine.loads``)
- ``CopyServer(stack, leases)``   — ``serve(tier, index, lease, wanted)`` → ``LoadResult``,
                                    called by ``daemon.engine.loads`` for each copy, fastest first;
                                    it owns ``lease``. A copy from below is promoted: from a
                                    tier that ``reads_in_place`` (disk, Redis) straight into an
                                    arena reservation, else by storing the bytes read; never
                                    while a delete runs, nor once the copy it came from was
                                    deleted (its lease still serves the load its bytes). Damage
                                    and refusals raise as ``protocol.classify`` found them.

No copy is digested here, from any tier, unless ``full_check`` (a client's recheck): the
client verifies the payload where it lands (the hashing rule, docs/protocol.md §6.1). The
tiers below read with ``read_unhashed`` (framing and signature checked), and a promotion
stores what it read unhashed: every later load of the promoted copy is verified by its
client too, and a damaged one is dropped by the recheck. Headers of hot objects are checked
once (``VerifiedHeaders``).
"""

from __future__ import annotations

import dataclasses
import logging

import msgspec

from statetier.protocol.classify import classify
from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.sealed import Expectation, VerifiedHeaders
from statetier.tiers.base import Lease, ObjectMeta, Tier

from .leases import Held, Leases
from ..requests import LoadResult
from .stack import Stack
from ..trace import phase

log = logging.getLogger("statetier.engine")


class Wanted(msgspec.Struct, frozen=True, gc=False):
    """What one load asks of each copy it tries (the same for every tier). One per load: a
    frozen msgspec Struct builds in a fraction of a frozen dataclass's µs."""

    state_id: bytes
    expectation: Expectation
    owner: object
    tenant: str
    full_check: bool = False
    layers: tuple[int, ...] | None = None  # a group object's layers the caller's specs describe
    delete_mark: int = 0  # ``Placement.delete_mark`` when the load began, before any copy was leased

    @property
    def judged(self) -> Expectation:
        """The expectation without the caller's tensor specs: a mismatch there is about the
        request (a caller's buffer), not damage, and must not drop the copy."""
        expectation = self.expectation
        return expectation if expectation.tensors is None else dataclasses.replace(expectation, tensors=None)


class CopyServer:
    def __init__(self, stack: Stack, leases: Leases) -> None:
        self.stack = stack
        self.leases = leases
        self._verified = VerifiedHeaders()  # headers of hot objects: signature checked once

    async def serve(self, tier: Tier, index: int, lease: Lease, wanted: Wanted) -> LoadResult:
        """Classify the leased copy found under ``wanted.state_id``; promote it when it came
        from below (``index > 0``). Owns ``lease``.

        An authenticated object of another identity under this id (a connector that wrote
        to the wrong key) is refused and *left in place*: it is no damage (removing it
        could destroy the only copy of the state it really is), it can never be served
        under this id (every load classifies again), it is evidence for ``statetier
        inspect``, and it ages out with the tier's LRU or TTL like any object.
        """
        promote = index > 0 and self.stack.options.promote_on_load
        kept = False
        try:
            if promote and tier.reads_in_place:
                landed = await self._load_into_arena(tier, lease, wanted)
                if landed is not None:
                    return landed
            # the hashing rule (docs/protocol.md §6.1): the client verifies the payload where
            # it lands, so a load digests nothing here; ``full_check`` (a client found a payload
            # that did not match) digests every copy, so a damaged one is dropped and the next served
            if wanted.full_check:
                blob = await tier.read(lease)
                trusted = tier.verifies_on_read  # that read digested it
            else:
                blob = await tier.read_unhashed(lease)
                trusted = True
            with phase("open" if trusted else "open_and_hash"):
                opened = await self._classify(blob, wanted, trusted)
            if promote:
                # the verified header says what this is, not the tier's index entry
                meta = dataclasses.replace(ObjectMeta.from_header(opened.header), tenant=lease.meta.tenant)
                promoted = await self._promote(blob, meta, tier, wanted)
                if promoted is not None:
                    lease_id, held = promoted
                    view = memoryview(await held.tier.read(held.lease)).cast("B")
                    return self._result(lease_id, held, opened.header, view)
            kept = True
            lease_id, held = self.leases.hold(tier, lease, wanted.owner)
            return self._result(lease_id, held, opened.header, memoryview(blob).cast("B"))
        finally:
            if not kept:
                await tier.complete_load(lease)

    async def _classify(self, blob, wanted: Wanted, trusted: bool):
        keyring, judged, verified = self.stack.keyring, wanted.judged, self._verified if trusted else None
        return await self.stack.run_work(
            0 if trusted else blob.nbytes,
            lambda: classify(blob, judged, keyring, stored_as=wanted.state_id, verify_payload=not trusted,
                             verified=verified))

    async def _load_into_arena(self, tier: Tier, lease: Lease, wanted: Wanted) -> LoadResult | None:
        """A promotion read straight into its arena reservation (the tier's ``read_into``) and
        classified there: no fresh buffer, no copy (``tier.reads_in_place``). None when it cannot be promoted (no room,
        quota, a copy already above, or a header whose meta differs from the tier's index
        entry): the caller then reads it as usual. Damage and refusals raise as from ``read``."""
        stack = self.stack
        target, meta = stack.arena, lease.meta
        if target is None or stack.tiers.index(target) > stack.tiers.index(tier):
            return None
        # as in ``serve``: the payload is digested (by the tier) only for a client's recheck
        read_into = tier.read_into if wanted.full_check else tier.read_into_unhashed
        opened, filling = None, False

        async def fill(view: memoryview):
            nonlocal opened, filling
            filling = True
            with phase("read_into_arena"):
                try:
                    await read_into(lease, view)
                except InvalidRequest:  # the bytes stored are not the size the tier's index says:
                    return None  # read them as usual (another object's bytes are judged there)
            opened = await self._classify(view, wanted, True)
            # the verified header says what this is: kept only if the index entry agrees
            return opened if ObjectMeta.from_header(opened.header) == meta else None

        async with stack.placement.cycle():
            if not await _may_promote(stack, meta.object_id, wanted, target) \
                    or stack.tenancy.would_exceed(wanted.tenant, target.name, meta.size):
                return None
            try:
                if await stack.placement.store_filled(target, meta, fill) is None:
                    return None
            except StatetierError as exc:
                if filling:
                    raise  # what the read or the classification found
                log.debug("promotion of %s into %s skipped: %s", meta.object_id.hex(), target.name, exc)
                return None  # no room in the arena (or a concurrent promotion won): read as usual
            stack.tenancy.charge(wanted.tenant, target.name, meta.object_id, meta.size)
            held_lease = await target.prepare_load(meta.object_id, owner=wanted.owner, ttl=stack.options.lease_ttl)
        stack.metrics.count_promotion(tier.name, target.name)
        lease_id, held = self.leases.hold(target, held_lease, wanted.owner)
        view = memoryview(await target.read(held_lease)).cast("B")
        assert opened is not None  # store_filled ran ``fill``
        return self._result(lease_id, held, opened.header, view)

    async def _promote(self, blob, meta: ObjectMeta, source: Tier, wanted: Wanted) -> tuple[int, Held] | None:
        stack = self.stack
        target = stack.arena or stack.tiers[0]
        if target is source or stack.tiers.index(target) > stack.tiers.index(source):
            return None
        oid = meta.object_id
        try:
            async with stack.placement.cycle():
                # a copy already above was not the one served (it was refused, or is not yet
                # judged): serve what was verified, never an unjudged copy in its place
                if not await _may_promote(stack, oid, wanted, target) \
                        or stack.tenancy.would_exceed(wanted.tenant, target.name, meta.size):
                    return None
                await stack.placement.store_in(target, [blob], meta)
                stack.tenancy.charge(wanted.tenant, target.name, oid, meta.size)
                lease = await target.prepare_load(oid, owner=wanted.owner, ttl=stack.options.lease_ttl)
        except StatetierError as exc:
            log.debug("promotion of %s into %s skipped: %s", meta.object_id.hex(), target.name, exc)
            return None
        stack.metrics.count_promotion(source.name, target.name)
        return self.leases.hold(target, lease, wanted.owner)

    def _result(self, lease_id: int, held: Held, header, blob: memoryview) -> LoadResult:
        return LoadResult(header, blob[header.header_len :], lease_id, held.tier.name, blob)


async def _may_promote(stack: Stack, object_id: bytes, wanted: Wanted, target: Tier) -> bool:
    """Whether a copy of ``object_id`` this load leased may be promoted into ``target`` (inside
    a placement cycle): not while a delete of it runs, nor when one ended since the load
    began — its lease still serves the load the bytes, but a promotion would bring the
    deleted (purged) object back — and not over a copy already there."""
    placement = stack.placement
    if placement.is_deleting(object_id) or placement.deleted_since(object_id, wanted.delete_mark):
        return False
    return not await target.contains(object_id)
