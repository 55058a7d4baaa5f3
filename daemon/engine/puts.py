"""The put path: seal, claim a version, place, publish, make durable (DESIGN §3, §5).

``Puts(stack, fences)`` — one per engine; ``Engine`` forwards its put calls here:

- ``put(req, payload)``       seal inline bytes, place, (publish), return ``PutResult``
- ``put_shared(req, source)`` a payload its client can still write: copied first (into an
                              arena reservation, or a private buffer), then digested there

A group object's regions must cover exactly its group's layers (``PlacementMismatch``,
counted). A put is visible only once sealed and complete; its version is claimed from the registry
first (``daemon.engine.fencing``); ``durable`` copies it into the durable tier before it returns;
``publish`` writes it through to the cross-node tier, or is refused without one (tolerated:
said in the reply and counted).
"""

from __future__ import annotations

import logging
import time

from statetier.protocol.errors import CapacityError, InvalidRequest, PlacementMismatch, StatetierError, Unavailable
from statetier.protocol.groups import check_regions
from statetier.protocol.identity import Provenance, StateRef, new_state_id, stream_id
from statetier.protocol.sealed import header_length, layout_payload, seal
from statetier.tiers.base import ObjectMeta, Tier

from .fencing import Fences
from ..requests import PutRequest, PutResult
from .stack import Stack
from ..trace import phase

log = logging.getLogger("statetier.engine")


class Puts:
    def __init__(self, stack: Stack, fences: Fences) -> None:
        self.stack = stack
        self.fences = fences

    async def put(self, req: PutRequest, payload) -> PutResult:
        self._check_put(req)
        view = memoryview(payload).cast("B")
        _check_length(view, layout_payload(req.specs))
        provenance = self._stamp(req.provenance)
        state_id = new_state_id()
        version = await self.fences.claim(req, provenance, state_id)
        return await self._seal_and_place(req, provenance, state_id, version, view)

    async def _seal_and_place(self, req: PutRequest, provenance: Provenance, state_id: bytes, version: int,
                              view: memoryview) -> PutResult:
        started, stack = time.perf_counter(), self.stack
        layout = layout_payload(req.specs)
        with phase("seal"):
            header = await stack.hash_off_loop(view.nbytes, seal, req.key, provenance, layout, view,
                                               keyring=stack.keyring, state_id=state_id, version=version,
                                               digest_alg=req.digest_alg, contains_speculative=req.speculative)
        meta = _meta(req, provenance, state_id, version, len(header), layout.payload_len)
        first = stack.tenancy.first_tier_within_quota(req.tenant, [t.name for t in stack.tiers], meta.size)
        tier = await stack.placement.store([header, view], meta, first=first)
        return await self._finish_put(req, meta, tier, [header, view], started)

    async def put_shared(self, req: PutRequest, source) -> PutResult:
        """Seal a payload that lies in memory its client can still write: copy it into the
        host arena (or a private buffer) first and digest that copy, so a change after the
        copy changes nothing stored."""
        stack = self.stack
        self._check_put(req)
        view = memoryview(source).cast("B")
        layout = layout_payload(req.specs)
        _check_length(view, layout)
        provenance = self._stamp(req.provenance)
        state_id = new_state_id()
        version = await self.fences.claim(req, provenance, state_id)
        if stack.arena is not None:
            header_len = header_length(req.key, provenance, req.specs, stack.keyring.active.alg)
            meta = _meta(req, provenance, state_id, version, header_len, layout.payload_len)
            first = stack.tenancy.first_tier_within_quota(req.tenant, [t.name for t in stack.tiers], meta.size)
            if stack.tiers[first] is stack.arena:
                try:
                    ticket = await stack.placement.prepare_with_room(stack.arena, meta)
                except CapacityError:
                    pass  # no room in the arena: a private copy goes to the tiers below
                else:
                    return await self._seal_in_arena(req, provenance, layout, ticket, view)
        private = await stack.hash_off_loop(view.nbytes, bytes, view)
        return await self._seal_and_place(req, provenance, state_id, version, memoryview(private))

    async def _seal_in_arena(self, req: PutRequest, provenance: Provenance, layout, ticket, source) -> PutResult:
        """Copy ``source`` into its arena reservation and seal it there (one executor job)."""
        started, stack = time.perf_counter(), self.stack
        meta, ok = ticket.meta, False
        try:
            with phase("copy_and_seal"):
                header = await stack.hash_off_loop(
                    layout.payload_len, _copy_then_seal, source, req.key, provenance, layout,
                    ticket.view[meta.header_len:], keyring=stack.keyring, state_id=meta.object_id,
                    version=meta.version, digest_alg=req.digest_alg, contains_speculative=req.speculative)
            ticket.view[: len(header)] = header
            ok = True
        finally:
            await stack.arena.complete_store(ticket, ok)
        return await self._finish_put(req, meta, stack.arena, None, started)

    async def _finish_put(self, req: PutRequest, meta: ObjectMeta, tier: Tier, chunks, started: float) -> PutResult:
        stack = self.stack
        publish_tier, placement, metrics = stack.publish, stack.placement, stack.metrics
        stack.tenancy.charge(req.tenant, tier.name, meta.object_id, meta.size)
        durable = tier.is_durable or (req.durable and await self._store_durably(meta, tier, chunks))
        if req.publish and publish_tier is not None and tier is not publish_tier:
            if chunks is None:  # zero-copy put: the object lives only in the arena
                await placement.copy_between(meta.object_id, tier, publish_tier)
            else:
                await placement.store_in(publish_tier, chunks, meta)
                stack.tenancy.copied(tier.name, publish_tier.name, meta.object_id)
        else:
            placement.schedule_copy_down(meta.object_id, tier)
        published = req.publish and publish_tier is not None
        if req.publish and not published:  # tolerated (``tolerate_unpublished``): said and counted
            log.warning("put of %s asked to publish; no cross-node tier: stored locally only", meta.object_id.hex())
            if metrics is not None:
                metrics.count_unpublished()
        if metrics is not None:
            metrics.observe_op(tier.name, meta.kind.name.lower(), "put", meta.size, time.perf_counter() - started)
        ref = StateRef(req.key, meta.request_id, meta.step, meta.object_id, meta.version)
        return PutResult(ref, tier.name, published, durable)

    async def _store_durably(self, meta: ObjectMeta, tier: Tier, chunks) -> bool:
        """A put asked to be durable: copy it into the durable tier now, not write-behind.
        False (the reply says so) when there is none or it cannot take the object."""
        stack = self.stack
        target = next((t for t in stack.tiers if t.is_durable), None)
        if target is None:
            return False
        try:
            if chunks is None:  # zero-copy put: the object lives only in the arena
                await stack.placement.copy_between(meta.object_id, tier, target)
            elif stack.tenancy.may_copy(tier.name, target.name, meta.object_id, meta.size):
                await stack.placement.store_in(target, chunks, meta)
                stack.tenancy.copied(tier.name, target.name, meta.object_id)
        except StatetierError as exc:
            log.debug("durable copy of %s into %s failed: %s", meta.object_id.hex(), target.name, exc)
            return False
        return await target.contains(meta.object_id)

    def _check_put(self, req: PutRequest) -> None:
        self.stack.tenancy.check_namespace(req.tenant, req.key.namespace)
        if req.publish and self.stack.publish is None and not self.stack.options.tolerate_unpublished:
            raise Unavailable("publish requested but this daemon has no cross-node tier (Redis): nothing "
                              "was stored or published")
        if req.key.kind.name == "SSM" and req.key.token_start != 0:
            raise InvalidRequest("an SSM snapshot must start at token 0")
        if req.key.group_layers:
            try:
                check_regions(req.key, [spec.name for spec in req.specs])
            except PlacementMismatch as exc:  # a region of a layer outside the group, or one missing
                self.stack.count_rejection(exc)
                raise

    def _stamp(self, prov: Provenance) -> Provenance:
        return Provenance(prov.request_id, prov.step, prov.producer_id or self.stack.options.producer_id,
                          prov.created_at_ns or time.time_ns())


def _check_length(view: memoryview, layout) -> None:
    if view.nbytes != layout.payload_len:
        raise InvalidRequest(f"payload is {view.nbytes} bytes; the tensors need {layout.payload_len}")


def _copy_then_seal(source, key, provenance, layout, payload, **options) -> bytes:
    payload[:] = source
    return seal(key, provenance, layout, payload, **options)


def _meta(req: PutRequest, provenance: Provenance, state_id: bytes, version: int, header_len: int,
          payload_len: int) -> ObjectMeta:
    return ObjectMeta(
        object_id=state_id, key_digest=req.key.digest(), stream_id=stream_id(req.key, provenance.request_id),
        version=version, kind=req.key.kind, size=header_len + payload_len, header_len=header_len,
        created_at_ns=provenance.created_at_ns, request_id=provenance.request_id, step=provenance.step,
        speculative=req.speculative)
