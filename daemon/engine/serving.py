"""Serving one leased copy: classify it, promote it when it came from below, hold it.

- ``Wanted``                      — what one load asks of every copy it tries: the state_id,
                                    the ``Expectation``, the owner, the tenant, ``full_check``,
                                    the deletes ended before it began (``delete_mark``);
                                    copies are classified against ``judged`` (the tensor specs
                                    are checked apart, by ``daemon.engine.loads``)
- ``CopyServer(stack, leases)``   — ``serve(tier, index, lease, wanted)`` → ``LoadResult``,
                                    called by ``daemon.engine.loads`` for each copy, fastest first;
                                    it owns ``lease``. A copy from below is promoted into free
                                    room only (``Placement.promote``: never an eviction on a
                                    load), run straight through: read into the reservation
                                    (the arena's view: no fresh buffer), classified there,
                                    ``Promotion.complete(ok)``, the promoted copy leased and
                                    served. With no room the copy from below is served and
                                    the promotion left to the write-behind worker. Damage
                                    and refusals raise as ``protocol.classify`` found them.

No copy is digested here, from any tier, unless ``full_check`` (a client's recheck): the
client verifies the payload where it lands (the hashing rule, docs/protocol.md §6.1). The
tiers below read with ``verify=False`` (framing and signature checked), and a promotion
stores what it read unhashed: every later load of the promoted copy is verified by its
client too, and a damaged one is dropped by the recheck. Headers of hot objects are checked
once (``VerifiedHeaders``).
"""

from __future__ import annotations

import dataclasses

import msgspec

from statetier.protocol.classify import classify
from statetier.protocol.errors import InvalidRequest
from statetier.protocol.sealed import Expectation, VerifiedHeaders
from statetier.tiers.base import Lease, ObjectMeta, Tier

from .leases import Held, Leases
from .promotion import Promotion
from ..requests import LoadResult
from .stack import Stack
from ..trace import phase

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
        from below (``index > 0``) and the tier above has free room. Owns ``lease``.

        An authenticated object of another identity under this id (a connector that wrote
        to the wrong key) is refused and *left in place*: it is no damage (removing it
        could destroy the only copy of the state it really is), it can never be served
        under this id (every load classifies again), it is evidence for ``statetier
        inspect``, and it ages out with the tier's LRU or TTL like any object.
        """
        kept = False
        try:
            promotion = await self._promotion(tier, index, lease, wanted)
            if promotion is not None:
                promoted = await self._serve_promoted(promotion, lease, wanted)
                if promoted is not None:
                    return promoted
            # the hashing rule (docs/protocol.md §6.1): the client verifies the payload where
            # it lands, so a load digests nothing here; ``full_check`` (a client found a payload
            # that did not match) digests every copy, so a damaged one is dropped and the next served
            blob = await tier.read(lease, verify=wanted.full_check)
            # the recheck's digest was taken by a tier that ``verifies_on_read``, else it is taken here
            opened = await self._classify(blob, wanted, not wanted.full_check or tier.verifies_on_read)
            kept = True
            lease_id, held = self.leases.hold(tier, lease, wanted.owner)
            return self._result(lease_id, held, opened.header, memoryview(blob).cast("B"))
        finally:
            if not kept:
                await tier.complete_load(lease)

    async def _promotion(self, tier: Tier, index: int, lease: Lease, wanted: Wanted) -> Promotion | None:
        """Free room above for the copy from below (``Placement.promote``), or None."""
        stack = self.stack
        if index == 0 or not stack.options.promote_on_load:
            return None
        return await stack.placement.promote(tier, lease, stack.arena or stack.tiers[0], tenant=wanted.tenant,
                                             delete_mark=wanted.delete_mark)

    async def _serve_promoted(self, promotion: Promotion, lease: Lease, wanted: Wanted) -> LoadResult | None:
        """The promotion run straight through: the copy read into its reservation (no fresh
        buffer where the target is written in place), classified there, the store completed
        (kept only when the verified header agrees with the tier's index entry), the promoted
        copy leased and served. None when it was not kept: the caller serves from below.
        Damage and refusals raise as ``protocol.classify`` found them."""
        ok, opened = False, None
        try:
            landed = await self._read_into_reservation(promotion, lease, wanted.full_check)
            if landed is not None:
                opened = await self._classify(landed, wanted,
                                              not wanted.full_check or promotion.source.verifies_on_read)
                # the verified header says what this is: kept only if the index entry agrees
                ok = ObjectMeta.from_header(opened.header) == lease.meta
        finally:
            held_lease = await promotion.complete(ok, owner=wanted.owner, ttl=self.stack.options.lease_ttl)
        if held_lease is None or opened is None:
            return None
        target = promotion.target
        lease_id, held = self.leases.hold(target, held_lease, wanted.owner)
        view = memoryview(await target.read(held_lease)).cast("B")
        return self._result(lease_id, held, opened.header, view)

    async def _read_into_reservation(self, promotion: Promotion, lease: Lease, verify: bool) -> memoryview | None:
        """The source copy's bytes in the promotion's reservation: read straight into its
        view where the target has one, else read and written; None when the bytes stored
        are not the size the tier's index says (read as usual: judged there)."""
        source, ticket = promotion.source, promotion.ticket
        try:
            if ticket.view is not None:
                with phase("read_into_arena"):
                    return await source.read(lease, into=ticket.view, verify=verify)
            blob = await source.read(lease, verify=verify)
            await promotion.target.write(ticket, [blob])
            return blob
        except InvalidRequest:
            return None

    async def _classify(self, blob, wanted: Wanted, trusted: bool):
        keyring, judged, verified = self.stack.keyring, wanted.judged, self._verified if trusted else None
        with phase("open" if trusted else "open_and_hash"):
            return await self.stack.run_work(
                0 if trusted else blob.nbytes,
                lambda: classify(blob, judged, keyring, stored_as=wanted.state_id, verify_payload=not trusted,
                                 verified=verified))

    def _result(self, lease_id: int, held: Held, header, blob: memoryview) -> LoadResult:
        return LoadResult(header, blob[header.header_len :], lease_id, held.tier.name, blob)

