"""The put path, a batch at a time: check, claim, reserve, seal, place (DESIGN §3, §5, §7).

``Puts(stack, fences)`` — one per engine; ``Engine.put_batch`` forwards here:

- ``put_batch(items)`` → one answer per ``Incoming`` (a request and its payload: bytes the
  daemon owns, or a put-window view its client can still write), in order: a ``PutResult``,
  the item's ``StatetierError``, or None — not attempted, because an item before it failed
  (as a caller raising the first error would have cancelled the rest).

A batch is the unit of work; a single put is a batch of one through the same code:

1. each item checked (namespace, publish — refused as ``RegistryUnavailable`` while the
   shared registry is unreachable, before anything is stored —, group regions, payload
   length, a tag's tokens within the key's span) and stamped
   (producer, time, state_id, fingerprint);
2. every version claimed in one registry call (``Fences.claim_many``);
3. room reserved for each in the first tier within its tenant's quota, in order: the host
   arena (the ticket's view) when that is the tier and it has room, else nothing yet;
4. every copy and digest in one job (``protocol.thresholds.run_work``: on the loop below
   ``INLINE_WORK_BYTES``, else one executor job): an item with a reservation is copied
   into it and sealed there; one in memory its client can write is copied into a private
   buffer first (so a change after the copy changes nothing stored); a frame's own bytes
   are sealed in place. An item from the put window that names its regions' digests
   (``Incoming.digests``, taken by the client as it copied) is sealed over them: copied,
   not hashed here (docs/protocol.md §6.1);
5. reservations completed (visible) in order, the other items stored through
   ``Placement.store``; then ``daemon.engine.handoff`` charges tenants, schedules
   write-behind or makes publish and durable copies, with one metric update per batch.

An item that fails stops the batch there; the claims of items that were not stored are
withdrawn (one registry call). A group object's regions must cover exactly its group's
layers (``PlacementMismatch``, counted). A put is visible only once sealed and complete.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from statetier.protocol.errors import (
    InvalidRequest,
    PlacementMismatch,
    RegistryUnavailable,
    StatetierError,
    Unavailable,
)
from statetier.protocol.groups import check_regions
from statetier.protocol.identity import Kind, Provenance, fingerprint, new_state_id, stream_id
from statetier.protocol.passes import PASSES, copy_into
from statetier.protocol.sealed import PayloadLayout, header_length, layout_payload, seal
from statetier.protocol.thresholds import run_work
from statetier.tiers.base import ObjectMeta, StoreTicket, Tier
from statetier.tiers.registry import Claim, Claimed

from .fencing import Fences
from .handoff import PutCompletion, Stored
from ..requests import Incoming, PutRequest, PutResult
from .stack import Stack
from ..trace import phase


@dataclass(slots=True)
class _Work:
    index: int  # the item's place in the batch
    req: PutRequest
    source: memoryview
    shared: bool
    provenance: Provenance
    layout: PayloadLayout
    claim: Claim
    fingerprint: bytes
    header_len: int
    digests: tuple[bytes, ...] | None = None  # the client's, taken as it wrote the put window
    claimed: Claimed | None = None
    meta: ObjectMeta | None = None
    first: int = 0  # the first tier within the tenant's quota
    ticket: StoreTicket | None = None  # a reservation in the host arena
    header: bytes = b""


class Puts:
    def __init__(self, stack: Stack, fences: Fences) -> None:
        self.stack = stack
        self.fences = fences
        self.handoff = PutCompletion(stack)
        self._tier_names = [tier.name for tier in stack.tiers]

    async def put_batch(self, items: list[Incoming]) -> list[PutResult | StatetierError | None]:
        started = time.perf_counter()
        answers: list[PutResult | StatetierError | None] = [None] * len(items)
        claimed = await self._claimed(self._checked(items, answers), answers)
        stored: list[Stored] = []
        try:
            work = await self._reserved(claimed, answers)
            await self._seal(work, answers)
            stored = await self._placed(work, answers)
        finally:
            if len(stored) < len(claimed):  # claimed, never stored: the registry forgets them
                placed = {s.index for s in stored}
                await self.fences.withdraw([(w.claim, w.claimed) for w in claimed
                                            if w.index not in placed and w.claimed is not None])
        await self.handoff.finish(stored, answers, started)
        return answers

    # -- 1. check and stamp ---------------------------------------------------------------

    def _checked(self, items: list[Incoming], answers: list) -> list[_Work]:
        work = []
        alg = self.stack.keyring.active.alg
        for index, item in enumerate(items):
            try:
                req = item.req
                self._check_put(req)
                layout = layout_payload(req.specs)
                if item.payload.nbytes != layout.payload_len:
                    raise InvalidRequest(f"payload is {item.payload.nbytes} bytes; the tensors need "
                                         f"{layout.payload_len}")
                provenance = self._stamp(req.provenance)
                claim = self.fences.new_claim(stream_id(req.key, provenance.request_id), new_state_id(), req.version)
                work.append(_Work(index, req, item.payload, item.shared, provenance, layout, claim,
                                  fingerprint(req.key, provenance.request_id, provenance.step),
                                  header_length(req.key, provenance, req.specs, alg), item.digests))
            except StatetierError as exc:
                answers[index] = exc
                break
        return work

    def _check_put(self, req: PutRequest) -> None:
        stack = self.stack
        stack.tenancy.check_namespace(req.tenant, req.key.namespace)
        if req.publish and stack.publishing.target is None and not stack.options.tolerate_unpublished:
            raise Unavailable("publish requested but this daemon has no cross-node tier (Redis): nothing "
                              "was stored or published")
        if req.publish and stack.publishing.target is not None and stack.registry.is_degraded:
            raise RegistryUnavailable("publish requested while the shared registry (Redis) is unreachable: "
                                      "nothing was stored or published (a local put is served; retry the "
                                      "publish once /readyz says ready)")
        if req.key.kind is Kind.SSM and req.key.token_start != 0:
            raise InvalidRequest("an SSM snapshot must start at token 0")
        if req.tag is not None and len(req.tag.tokens) > req.key.token_end - req.key.token_start:
            raise InvalidRequest(f"the tag names {len(req.tag.tokens)} tokens; the key spans "
                                 f"{req.key.token_end - req.key.token_start}")
        if req.key.group_layers:
            try:
                check_regions(req.key, [spec.name for spec in req.specs])
            except PlacementMismatch as exc:  # a region of a layer outside the group, or one missing
                stack.count_rejection(exc)
                raise

    def _stamp(self, prov: Provenance) -> Provenance:
        if prov.producer_id and prov.created_at_ns:
            return prov
        return Provenance(prov.request_id, prov.step, prov.producer_id or self.stack.options.producer_id,
                          prov.created_at_ns or time.time_ns())

    # -- 2. claim ---------------------------------------------------------------------------

    async def _claimed(self, work: list[_Work], answers: list) -> list[_Work]:
        if not work:
            return work
        kept = []
        for w, claimed in zip(work, await self.fences.claim_many([w.claim for w in work])):
            if not isinstance(claimed, Claimed):
                if claimed is not None:
                    answers[w.index] = claimed  # stale: the batch ends here (the claims after it are not made)
                break
            w.claimed = claimed
            w.meta = _meta(w, claimed.version)
            kept.append(w)
        return await self._unless_publishing_in_an_outage(kept, answers)

    async def _unless_publishing_in_an_outage(self, kept: list[_Work], answers: list) -> list[_Work]:
        """Claims that met an unreachable registry were made from this daemon's view: a publish
        among them would be half done (stored here, not in Redis), so it is refused before
        anything is stored; the batch ends there and its claims and the later ones are withdrawn."""
        if not self.stack.registry.is_degraded:
            return kept
        cut = next((n for n, w in enumerate(kept) if w.req.publish), None)
        if cut is None:
            return kept
        answers[kept[cut].index] = RegistryUnavailable(
            "publish requested while the shared registry (Redis) became unreachable: nothing was stored or published")
        await self.fences.withdraw([(w.claim, w.claimed) for w in kept[cut:] if w.claimed is not None])
        return kept[:cut]

    # -- 3. reserve -------------------------------------------------------------------------

    async def _reserved(self, work: list[_Work], answers: list) -> list[_Work]:
        """Each item's first tier within quota, and an arena reservation (one eviction for
        the batch) for those whose first tier is the arena, while it has room: the others are
        sealed apart and placed from their first tier on. The items up to the first that fails."""
        stack = self.stack
        arena = stack.arena
        pending: dict[str, int] = {}  # bytes of the batch not charged yet, per tenant (any tier)
        for n, w in enumerate(work):
            assert w.meta is not None  # claimed
            try:
                tenant = w.req.tenant
                w.first = stack.tenancy.first_tier_within_quota(
                    tenant, self._tier_names, w.meta.size + pending.get(tenant, 0))
                pending[tenant] = pending.get(tenant, 0) + w.meta.size
            except StatetierError as exc:
                answers[w.index] = exc
                work = work[: n + 1]  # w's claim is withdrawn with the others not stored
                break
        if arena is not None:
            wanted = [w for w in work if answers[w.index] is None and stack.tiers[w.first] is arena]
            metas = [w.meta for w in wanted if w.meta is not None]  # every one: claimed
            for w, ticket in zip(wanted, await stack.placement.prepare_all(arena, metas)):
                w.ticket = ticket
        return work

    # -- 4. copy and seal -------------------------------------------------------------------

    async def _seal(self, work: list[_Work], answers: list) -> None:
        """Every copy and digest of the batch in one job; on failure every reservation is
        given back and the first item answers the error."""
        todo = [w for w in work if answers[w.index] is None]
        if not todo:
            return
        keyring = self.stack.keyring
        nbytes = sum(w.layout.payload_len for w in todo)
        try:
            with phase("copy_and_seal"):
                await run_work(self.stack.executor, nbytes, lambda: _seal_all(todo, keyring))
        except BaseException as exc:
            for w in todo:
                if w.ticket is not None:
                    assert self.stack.arena is not None  # a ticket is an arena reservation
                    await self.stack.arena.complete_store(w.ticket, False)
                    w.ticket = None
            if isinstance(exc, StatetierError):
                answers[todo[0].index] = exc
                todo.clear()
                return
            raise

    # -- 5. make visible --------------------------------------------------------------------

    async def _placed(self, work: list[_Work], answers: list) -> list[Stored]:
        """Reservations completed, the other items stored, in order; after the first failure
        the reservations left are given back."""
        stack = self.stack
        stored: list[Stored] = []
        failed = False
        for w in work:
            assert w.meta is not None  # claimed
            if answers[w.index] is not None or failed:
                failed = True
                if w.ticket is not None:
                    assert stack.arena is not None  # a ticket is an arena reservation
                    await stack.arena.complete_store(w.ticket, False)
                continue
            try:
                if w.ticket is not None:
                    assert stack.arena is not None  # a ticket is an arena reservation
                    ticket, w.ticket = w.ticket, None
                    await stack.arena.complete_store(ticket, True)
                    tier: Tier = stack.arena
                    chunks = None
                else:
                    chunks = [w.header, w.source]
                    tier = await stack.placement.store(chunks, w.meta, first=w.first)
            except StatetierError as exc:
                answers[w.index] = exc
                failed = True
                continue
            stored.append(Stored(w.index, w.req, w.meta, tier, chunks, w.fingerprint))
        return stored


def _seal_all(work: list[_Work], keyring) -> None:
    """Seal each item: into its arena reservation (copied there first), from a private copy
    of client-writable bytes, or in place."""
    for w in work:
        req, meta = w.req, w.meta
        assert meta is not None  # claimed
        if w.ticket is not None:
            assert w.ticket.view is not None  # the arena writes in place
            payload = w.ticket.view[meta.header_len :]
            copy_into(payload, w.source)
        elif w.shared:
            payload = w.source = memoryview(bytes(w.source))
            PASSES.count_copied(payload.nbytes)
        else:
            payload = w.source
        w.header = seal(req.key, w.provenance, w.layout, payload, keyring=keyring, state_id=meta.object_id,
                        version=meta.version, digest_alg=req.digest_alg, contains_speculative=req.speculative,
                        fingerprint=w.fingerprint, region_digests=w.digests)
        if len(w.header) != meta.header_len:
            raise InvalidRequest(f"sealed a {len(w.header)}-byte header, {meta.header_len} were reserved")
        if w.ticket is not None and w.ticket.view is not None:
            w.ticket.view[: meta.header_len] = w.header


def _meta(w: _Work, version: int) -> ObjectMeta:
    req, provenance = w.req, w.provenance
    return ObjectMeta(
        object_id=w.claim.state_id, key_digest=req.key.digest(), stream_id=w.claim.stream_id, version=version,
        kind=req.key.kind, size=w.header_len + w.layout.payload_len, header_len=w.header_len,
        created_at_ns=provenance.created_at_ns, request_id=provenance.request_id, step=provenance.step,
        speculative=req.speculative, namespace=req.key.namespace.digest, tenant=req.tenant)
