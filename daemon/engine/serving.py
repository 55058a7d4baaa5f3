"""Serving one load from the tiers: its copies fastest first, each classified, promoted when
it came from below, held.

- ``Wanted``                      — what one load asks of every copy it tries: the state_id,
                                    the ``Expectation``, the owner, the tenant, ``full_check``,
                                    the deletes ended before it began (``delete_mark``);
                                    copies are classified against ``judged`` (the tensor specs
                                    are checked apart, once a copy passed)
- ``CopyServer(stack, leases)``   — ``load_object(wanted, counted=)`` → ``LoadResult``, called
                                    by ``daemon.engine.loads`` for each object it loads;
                                    ``serve(tier, index, lease, wanted)`` → ``LoadResult``,
                                    one leased copy (it owns ``lease``)

``load_object`` serves the fastest copy that ``protocol.classify`` accepts. A hit is counted,
for the tier that held the copy, only once a copy is handed over (never for a refusal, of
the copy or of the caller's tensor specs). A damaged copy is dropped
(``daemon.engine.deletion.drop_copy``) and the next tried, never unverified bytes; an intact
copy of another identity is refused with its §4 reason, left in place, and the next tried.
The tensor specs a caller expects are checked apart, after (of a group object, those of the
layers asked for): a mismatch is about the request, not damage. With no copy anywhere, what
the registry's knowledge refuses (``protocol.expectation.registry_refusal``) is the answer;
a load that finds its object in no tier while moves are under way settles them and looks
again.

``serve`` promotes a copy from below into free room only (``Placement.promote``: never an
eviction on a load), run straight through: read into the reservation (the arena's view: no
fresh buffer), classified there, ``Promotion.complete(ok)``, the promoted copy leased and
served. With no room the copy from below is served and the promotion left to the
write-behind worker. Damage and refusals raise as ``protocol.classify`` found them. A copy
its batch pulled already (``Wanted.pulled``, ``daemon.engine.pulls``) comes with its lease
and reservation: served from where it landed, as if read there now.

No copy is digested here, from any tier, unless ``full_check`` (a client's recheck): the
client verifies the payload where it lands (the hashing rule, docs/protocol.md §6.1). The
tiers below read with ``verify=False`` (framing and signature checked), and a promotion
stores what it read unhashed: every later load of the promoted copy is verified by its
client too, and a damaged one is dropped by the recheck. Headers of hot objects are checked
once (``VerifiedHeaders``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgspec

from statetier.protocol.classify import classify, is_damage, skip_reason
from statetier.protocol.errors import (
    DestinationMismatch,
    InvalidRequest,
    NotFound,
    RejectedState,
    StatetierError,
    Unavailable,
)
from statetier.protocol.expectation import registry_refusal
from statetier.protocol.groups import chosen
from statetier.protocol.sealed import Expectation, VerifiedHeaders
from statetier.tiers.base import Lease, ObjectMeta, Tier

from .deletion import drop_copy
from .leases import Held, Leases
from .promotion import Promotion
from .pulls import Pulled
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
    pulled: Pulled | None = None  # its copy, pulled with the rest of its batch (``daemon.engine.pulls``)

    @property
    def judged(self) -> Expectation:
        """The expectation without the caller's tensor specs: a mismatch there is about the
        request (a caller's buffer), not damage, and must not drop the copy."""
        expectation = self.expectation
        return expectation if expectation.tensors is None else dataclasses.replace(expectation, tensors=None)


@dataclass(slots=True)
class _Passed:
    """Why the copies tried so far were passed over: the first of each kind."""

    damaged: RejectedState | None = None
    refused: RejectedState | None = None  # the first identity refusal, counted once per load
    unavailable: Unavailable | None = None


class CopyServer:
    def __init__(self, stack: Stack, leases: Leases) -> None:
        self.stack = stack
        self.leases = leases
        self._verified = VerifiedHeaders()  # headers of hot objects: signature checked once

    async def load_object(self, wanted: Wanted, *, counted: bool = True) -> LoadResult:
        """Serve the fastest copy that ``protocol.classify`` accepts (``_look``); when no tier
        holds one while moves are under way (its object may be between two tiers), settle
        them and look once more. ``counted=False`` counts a refusal as a skipped candidate
        (the caller tries the next candidate)."""
        stack = self.stack
        for second_look in (False, True):
            result = await self._look(wanted, counted)
            if result is not None:
                return result
            if second_look or not stack.placement.has_relocations:
                break
            await stack.placement.settle_relocations()  # not the promotions loads hold (their batch's too)
        if counted:
            stack.count_miss(wanted.expectation.key)
        raise NotFound(f"state {wanted.state_id.hex()} is in no tier{_no_shared_tier_hint(stack)}")

    async def _look(self, wanted: Wanted, counted: bool) -> LoadResult | None:
        """Each tier's copy, fastest first, until one passes. A damaged copy is removed
        (counted as damage) and the next copy tried; an intact copy of another identity is
        refused with its §4 reason, left where it is (see ``serve``), and the next copy
        tried too: when one passes it is served and the refusal still counted, once. When
        none passes, the first identity refusal is the answer (the copies agree, so the
        request is what is wrong), then damage, then what the registry refuses, then a tier
        that could not answer. None: no tier holds a copy."""
        stack, passed = self.stack, _Passed()
        for index, tier in enumerate(stack.tiers):
            tried = await self._try_copy(tier, index, wanted)
            if isinstance(tried, LoadResult):
                return await self._hand_over(tried, tier, wanted, passed, counted)
            if tried is not None and self._passed_over(tried, passed, wanted.state_id):
                await drop_copy(stack, tier, wanted.state_id)
        if passed.refused is not None:
            self._count_refusal(passed.refused, counted, wanted.state_id)
            raise passed.refused
        if passed.damaged is not None:
            raise passed.damaged
        refused = registry_refusal(wanted.state_id, wanted.expectation)  # no copy anywhere: the registry says why
        if refused is not None:
            stack.count_rejection(refused, wanted.state_id)
            raise refused
        if passed.unavailable is not None:
            raise passed.unavailable
        return None

    async def _try_copy(self, tier: Tier, index: int, wanted: Wanted) -> LoadResult | StatetierError | None:
        """``tier``'s copy served; or why it was passed over; None when ``tier`` holds none.
        A copy its batch pulled already (``wanted.pulled``) is served from where it landed."""
        pulled = wanted.pulled
        if pulled is not None and pulled.tier is tier and pulled.claim():
            lease = pulled.lease
        else:
            pulled = None
            try:
                lease = await tier.prepare_load(wanted.state_id, owner=wanted.owner, ttl=self.stack.options.lease_ttl)
            except NotFound:
                return None
            except Unavailable as exc:
                return exc
        try:
            return await self.serve(tier, index, lease, wanted, pulled)
        except (RejectedState, Unavailable) as exc:
            return exc

    def _passed_over(self, exc: StatetierError, passed: _Passed, state_id: bytes) -> bool:
        """Note why a copy was passed over (the first of each kind); True when it is damaged
        (counted once per load: a promoted copy carries its source's damage), to be dropped."""
        if isinstance(exc, Unavailable):
            passed.unavailable = passed.unavailable or exc
            return False
        assert isinstance(exc, RejectedState)  # ``_try_copy`` passes over nothing else
        if not is_damage(exc):
            passed.refused = passed.refused or exc
            return False
        if passed.damaged is None:
            self.stack.count_rejection(exc, state_id)
            passed.damaged = exc
        return True

    async def _hand_over(self, result: LoadResult, tier: Tier, wanted: Wanted, passed: _Passed,
                         counted: bool) -> LoadResult:
        """The copy that passed, once the caller's tensor specs agree (else its lease released and
        ``DestinationMismatch``: about the request, not the bytes); a hit only now, the bytes the
        caller's. A copy above that was another object (served from below) is said, once."""
        if passed.refused is not None:
            self._count_refusal(passed.refused, counted, wanted.state_id)
        specs = wanted.expectation.tensors
        found = tuple(t.spec for t in chosen(result.header.tensors, wanted.layers))
        if specs is not None and found != tuple(specs):
            await self.leases.release(result.lease_id, wanted.owner)
            raise DestinationMismatch(f"the object holds tensors {[(s.name, s.dtype, s.shape) for s in found]}; "
                                      f"the destination expects {[(s.name, s.dtype, s.shape) for s in specs]}")
        self.stack.metrics.count_hit(tier.name, wanted.expectation.key.kind.name.lower())
        return result

    def _count_refusal(self, exc: RejectedState, counted: bool, state_id: bytes) -> None:
        if counted:
            self.stack.count_rejection(exc, state_id)
        else:
            self.stack.count_skip(skip_reason(exc))

    async def serve(self, tier: Tier, index: int, lease: Lease, wanted: Wanted,
                    pulled: Pulled | None = None) -> LoadResult:
        """Classify the leased copy found under ``wanted.state_id``; promote it when it came
        from below (``index > 0``) and the tier above has free room. Owns ``lease`` (and,
        given ``pulled``, its promotion: the copy already pulled, served where it landed).

        An authenticated object of another identity under this id (a connector that wrote
        to the wrong key) is refused and *left in place*: it is no damage (removing it
        could destroy the only copy of the state it really is), it can never be served
        under this id (every load classifies again), it is evidence for ``statetier
        inspect``, and it ages out with the tier's LRU or TTL like any object.
        """
        kept = False
        try:
            promotion = pulled.promotion if pulled is not None else await self._promotion(tier, index, lease, wanted)
            if promotion is not None:
                promoted = await self._serve_promoted(promotion, lease, wanted, pulled)
                if promoted is not None:
                    return promoted
            # the hashing rule (docs/protocol.md §6.1): the client verifies the payload where
            # it lands, so a load digests nothing here; ``full_check`` (a client found a payload
            # that did not match) digests every copy, so a damaged one is dropped and the next served
            if pulled is not None and promotion is None:
                blob = await pulled.landed()
            else:
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

    async def _serve_promoted(self, promotion: Promotion, lease: Lease, wanted: Wanted,
                              pulled: Pulled | None) -> LoadResult | None:
        """The promotion run straight through: the copy read into its reservation (no fresh
        buffer where the target is written in place), classified there, the store completed
        (kept only when the verified header agrees with the tier's index entry), the promoted
        copy leased and served. None when it was not kept: the caller serves from below.
        Damage and refusals raise as ``protocol.classify`` found them."""
        ok, opened = False, None
        try:
            landed = await self._read_into_reservation(promotion, lease, wanted.full_check, pulled)
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

    async def _read_into_reservation(self, promotion: Promotion, lease: Lease, verify: bool,
                                     pulled: Pulled | None) -> memoryview | None:
        """The source copy's bytes in the promotion's reservation: read straight into its
        view where the target has one (``pulled``: already received there), else read and
        written; None when the bytes stored are not the size the tier's index says (read as
        usual: judged there)."""
        source, ticket = promotion.source, promotion.ticket
        try:
            if ticket.view is not None:
                with phase("read_into_arena"):
                    if pulled is not None:
                        return await pulled.landed()
                    return await source.read(lease, into=ticket.view, verify=verify)
            blob = await (pulled.landed() if pulled is not None else source.read(lease, verify=verify))
            await promotion.target.write(ticket, [blob])
            return blob
        except InvalidRequest:
            return None

    async def _classify(self, blob, wanted: Wanted, trusted: bool):
        """``protocol.classify``: ``trusted``, the header checked (once per hot object) and the
        payload left to the client; else the payload digested too (``run_work``, by its size)."""
        keyring, judged, stored_as, verified = self.stack.keyring, wanted.judged, wanted.state_id, self._verified
        if trusted:
            with phase("open"):
                return await self.stack.run_work(0, lambda: classify(blob, judged, keyring, stored_as=stored_as,
                                                                     verify_payload=False, verified=verified))
        with phase("open_and_hash"):
            return await self.stack.run_work(blob.nbytes, lambda: classify(blob, judged, keyring, stored_as=stored_as,
                                                                           verify_payload=True, verified=None))

    def _result(self, lease_id: int, held: Held, header, blob: memoryview) -> LoadResult:
        return LoadResult(header, blob[header.header_len :], lease_id, held.tier.name, blob)



def _no_shared_tier_hint(stack) -> str:
    """What a miss means on a daemon without a cross-node tier: only its own puts are found."""
    if stack.publishing.target is not None:
        return ""
    return (" of this daemon, and it has no Redis tier (redis.url unset): only objects put through this daemon "
            "are found here; a ref from another node needs both daemons on one Redis")
