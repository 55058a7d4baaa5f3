"""The engine: the tier hierarchy behind the daemon's requests (DESIGN §4–6).

``Engine(tiers, keyring=, registry=, metrics=, options=, arena=, publish=, executor=)`` —
``tiers`` ordered fastest first (device, host, disk, redis; any may be absent); ``arena``
is the host tier whose shared memory same-host clients map; ``publish`` the cross-node
tier (Redis). The server calls, per request:

- ``put(req, payload)``                 seal inline bytes, place, (publish), return the ref
- ``put_shared(req, source, owner)``   a put whose payload lies where its client can still
                                        write it (the connection's put window): copied into
                                        memory only the daemon writes, then digested there
- ``reserve(req, owner)`` → ``commit(ticket_id, owner, source)`` / ``abort(ticket_id, owner)``
                                        the same, in two steps, through the host arena
- ``expect_refs(reqs)``                the registry reads of a batch of loads, concurrently,
                                        handed to ``load(req, owner, expected=)``
- ``load(req, owner)``                  find, verify in DESIGN §4 order, promote (from a
                                        tier that ``reads_in_place``, the disk, straight
                                        into the arena reservation); the
                                        result stays leased until ``release(lease_id)``. A
                                        copy in daemon-only memory (host, device) is not
                                        digested again: the client verifies the payload
                                        where it lands (DESIGN §6), and asks again with
                                        ``full_check`` when that fails
- ``lookup(req, owner)``                the joint hit (``daemon.lookup``)
- ``release(lease_id, owner)`` / ``release_owner(owner)`` (a connection went away)
- ``delete(tenant, ref)``               every copy gone once it returns (moves settled)
- ``inspect(tenant, state_id)``, ``verify_all(tenant)`` (``daemon.audit``), ``stats()``

Rules kept here: a put becomes visible only when sealed and complete; the version
registry fences stale puts and loads; every copy is judged by ``protocol.classify``: a
damaged copy is removed and the load falls through to the next copy, never to unverified
bytes; an intact copy of another identity is refused with its DESIGN §4 reason, left in
place, and the next copy tried; a load by key serves the best valid candidate, counting
what it skipped; eviction demotes (``daemon.placement``); ``publish`` writes through to
the cross-node tier before the put returns, and without one is refused (or, tolerated,
said in the reply and counted); tenant bytes follow every copy (``daemon.tenancy``);
a put asking to be ``durable`` is copied into the durable tier (``Tier.is_durable``: the
disk tier with fsync) before it returns, and ``PutResult.durable`` says whether a durable
tier held it then; a load that finds its object in no tier while moves are under way
settles them and looks again (an eviction may hold it between two tiers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, field

from statetier.protocol.classify import classify, is_damage, skip_reason
from statetier.protocol.errors import (
    CapacityError,
    CorruptPayload,
    Forbidden,
    InvalidRequest,
    LeaseError,
    MisroutedState,
    NotFound,
    RejectedState,
    StaleState,
    StatetierError,
    Unavailable,
)
from statetier.protocol.identity import Provenance, StateKey, StateRef, new_state_id, stream_id
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import Expectation, VerifiedHeaders, header_length, layout_payload, seal
from statetier.tiers.base import Lease, ObjectMeta, Tier
from statetier.tiers.registry import VersionRegistry

from . import audit
from .lookup import joint_hit
from .placement import Placement
from .trace import phase
from .requests import LoadRequest, LoadResult, LookupRequest, LookupResult, PutRequest, PutResult, Reservation
from .tenancy import Tenancy

log = logging.getLogger("statetier.engine")

#: Below this many bytes hashing inline beats a hop to the executor.
INLINE_HASH_BYTES = 256 * 1024
#: state_id → the stream it was issued for, remembered for this many state_ids (the
#: mapping never changes once claimed; a load by ref then reads only the stream's head).
STREAMS_REMEMBERED = 1 << 16
#: Loads of one batch whose registry reads are in flight at once (two reads each; the
#: Redis pool holds 64 connections).
REGISTRY_READS_AT_ONCE = 16


@dataclass(frozen=True, slots=True)
class EngineOptions:
    lease_ttl: float = 30.0
    producer_id: str = ""
    quotas: dict = field(default_factory=dict)  # tenant -> {tier name -> bytes}
    write_behind_limit: int = 256
    promote_on_load: bool = True
    #: a put with ``publish`` and no cross-node tier: refused (False) or stored locally,
    #: said in the reply and counted (True)
    tolerate_unpublished: bool = False


@dataclass(slots=True)
class _Held:
    """An engine lease: one tier lease, known to its owner (a connection)."""

    tier: Tier
    lease: Lease
    owner: object


class Engine:
    def __init__(self, tiers: list[Tier], *, keyring: Keyring, registry: VersionRegistry, metrics=None,
                 options: EngineOptions | None = None, arena: Tier | None = None, publish: Tier | None = None,
                 write_behind_to: Tier | None = None, executor: Executor | None = None) -> None:
        if not tiers:
            raise InvalidRequest("the engine needs at least one tier")
        self.tiers = list(tiers)
        self.keyring = keyring
        self.registry = registry
        self.metrics = metrics
        self.options = options or EngineOptions()
        self.arena = arena
        self.publish_tier = publish
        self.executor = executor
        volatile = self.tiers[: self.tiers.index(write_behind_to)] if write_behind_to in self.tiers else []
        self.tenancy = Tenancy(self.options.quotas)
        self.placement = Placement(self.tiers, metrics, write_behind_limit=self.options.write_behind_limit,
                                   write_behind_from=volatile, write_behind_to=write_behind_to,
                                   ledger=self.tenancy)
        self._ids = itertools.count(1)
        self._held: dict[int, _Held] = {}
        self._reservations: dict[int, tuple[Reservation, object]] = {}
        self._verified = VerifiedHeaders()  # headers of hot objects: signature checked once
        self._issued: OrderedDict[bytes, bytes] = OrderedDict()  # state_id -> stream (``_stream_of``)
        self._tasks: list[asyncio.Task] = []
        self.ready = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        started: list[Tier] = []
        try:
            for tier in self.tiers:
                await tier.start()
                started.append(tier)
        except BaseException:
            for tier in reversed(started):
                await tier.close()
            raise
        self._tasks.append(asyncio.create_task(self.placement.run_write_behind(), name="write-behind"))
        self.ready = True

    async def close(self, flush_seconds: float = 10.0) -> None:
        self.ready = False
        await self.placement.flush_write_behind(flush_seconds)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for owner in {held.owner for held in self._held.values()} | {o for _, o in self._reservations.values()}:
            await self.release_owner(owner)
        for tier in reversed(self.tiers):
            try:
                await tier.close()
            except StatetierError:
                log.exception("closing tier %s failed", tier.name)
        await self.registry.close()

    # ---------------------------------------------------------------- puts

    async def put(self, req: PutRequest, payload) -> PutResult:
        started = time.perf_counter()
        self._check_put(req)
        view = memoryview(payload).cast("B")
        layout = layout_payload(req.specs)
        if view.nbytes != layout.payload_len:
            raise InvalidRequest(f"payload is {view.nbytes} bytes; the tensors need {layout.payload_len}")
        provenance = self._stamp(req.provenance)
        state_id = new_state_id()
        version = await self._claim(req, provenance, state_id)
        with phase("seal"):
            header = await self.hash_off_loop(view.nbytes, seal, req.key, provenance, layout, view,
                                              keyring=self.keyring, state_id=state_id, version=version,
                                              digest_alg=req.digest_alg, contains_speculative=req.speculative)
        meta = _meta(req, provenance, state_id, version, len(header), layout.payload_len)
        first = self.tenancy.first_tier_within_quota(req.tenant, [t.name for t in self.tiers], meta.size)
        tier = await self.placement.store([header, view], meta, first=first)
        return await self._finish_put(req, meta, tier, [header, view], started)

    async def reserve(self, req: PutRequest, owner) -> Reservation:
        if self.arena is None:
            raise Unavailable("zero-copy puts need the host tier, which is not configured")
        self._check_put(req)
        provenance = self._stamp(req.provenance)
        layout = layout_payload(req.specs)
        header_len = header_length(req.key, provenance, req.specs, self.keyring.active.alg)
        state_id = new_state_id()
        version = await self._claim(req, provenance, state_id)
        meta = _meta(req, provenance, state_id, version, header_len, layout.payload_len)
        ticket = await self.placement._prepare_with_room(self.arena, meta)
        ticket_id = next(self._ids)
        reservation = Reservation(ticket_id, dataclasses.replace(req, provenance=provenance), layout,
                                  self.arena.arena_offset(ticket) + header_len, ticket.view[header_len:],
                                  owner, ticket)
        self._reservations[ticket_id] = (reservation, owner)
        return reservation

    async def put_shared(self, req: PutRequest, source, owner) -> PutResult:
        """Seal a payload that lies in memory its client can still write: copy it into the
        host arena (or a private buffer) first and digest that copy, so a change after the
        copy changes nothing stored."""
        view = memoryview(source).cast("B")
        layout = layout_payload(req.specs)
        if view.nbytes != layout.payload_len:
            raise InvalidRequest(f"payload is {view.nbytes} bytes; the tensors need {layout.payload_len}")
        if self.arena is not None:
            size = header_length(req.key, self._stamp(req.provenance), req.specs, self.keyring.active.alg) + view.nbytes
            first = self.tenancy.first_tier_within_quota(req.tenant, [t.name for t in self.tiers], size)
            if self.tiers[first] is self.arena:
                try:
                    reservation = await self.reserve(req, owner)
                except CapacityError:
                    pass  # no room in the arena: a private copy goes to the tiers below
                else:
                    return await self.commit(reservation.ticket_id, owner, view)
        private = await self.hash_off_loop(view.nbytes, bytes, view)
        return await self.put(req, private)

    async def commit(self, ticket_id: int, owner, source=None) -> PutResult:
        """Seal a reservation; with ``source``, copy it into the reservation first (in the
        same executor job as the digest)."""
        started = time.perf_counter()
        reservation = self._take_reservation(ticket_id, owner)
        ticket, req = reservation.state, reservation.request
        ok = False
        try:
            meta = ticket.meta
            with phase("copy_and_seal" if source is not None else "seal"):
                header = await self.hash_off_loop(
                    reservation.layout.payload_len, _copy_then_seal, source, req.key, req.provenance,
                    reservation.layout, reservation.payload_view, keyring=self.keyring, state_id=meta.object_id,
                    version=meta.version, digest_alg=req.digest_alg, contains_speculative=req.speculative)
            ticket.view[: len(header)] = header
            ok = True
        finally:
            await self.arena.complete_store(ticket, ok)
        return await self._finish_put(req, meta, self.arena, None, started)

    async def abort(self, ticket_id: int, owner) -> None:
        reservation = self._take_reservation(ticket_id, owner)
        await self.arena.complete_store(reservation.state, False)

    def _take_reservation(self, ticket_id: int, owner) -> Reservation:
        entry = self._reservations.get(ticket_id)
        if entry is None or entry[1] != owner:
            raise InvalidRequest(f"no open reservation {ticket_id} on this connection")
        del self._reservations[ticket_id]
        return entry[0]

    async def _finish_put(self, req: PutRequest, meta: ObjectMeta, tier: Tier, chunks, started: float) -> PutResult:
        self.tenancy.charge(req.tenant, tier.name, meta.object_id, meta.size)
        durable = tier.is_durable or (req.durable and await self._store_durably(meta, tier, chunks))
        if req.publish and self.publish_tier is not None and tier is not self.publish_tier:
            if chunks is None:  # zero-copy put: the object lives only in the arena
                await self.placement.copy_between(meta.object_id, tier, self.publish_tier)
            else:
                await self.placement.store_in(self.publish_tier, chunks, meta)
                self.tenancy.copied(tier.name, self.publish_tier.name, meta.object_id)
        else:
            self.placement.schedule_copy_down(meta.object_id, tier)
        published = req.publish and self.publish_tier is not None
        if req.publish and not published:  # tolerated (``tolerate_unpublished``): said and counted
            log.warning("put of %s asked to publish; no cross-node tier: stored locally only", meta.object_id.hex())
            if self.metrics is not None:
                self.metrics.count_unpublished()
        if self.metrics is not None:
            self.metrics.observe_op(tier.name, meta.kind.name.lower(), "put", meta.size, time.perf_counter() - started)
        ref = StateRef(req.key, meta.request_id, meta.step, meta.object_id, meta.version)
        return PutResult(ref, tier.name, published, durable)

    async def _store_durably(self, meta: ObjectMeta, tier: Tier, chunks) -> bool:
        """A put asked to be durable: copy it into the durable tier now, not write-behind.
        False (the reply says so) when there is none or it cannot take the object."""
        target = next((t for t in self.tiers if t.is_durable), None)
        if target is None:
            return False
        try:
            if chunks is None:  # zero-copy put: the object lives only in the arena
                await self.placement.copy_between(meta.object_id, tier, target)
            elif self.tenancy.may_copy(tier.name, target.name, meta.object_id, meta.size):
                await self.placement.store_in(target, chunks, meta)
                self.tenancy.copied(tier.name, target.name, meta.object_id)
        except StatetierError as exc:
            log.debug("durable copy of %s into %s failed: %s", meta.object_id.hex(), target.name, exc)
            return False
        return await target.contains(meta.object_id)

    async def _claim(self, req: PutRequest, provenance: Provenance, state_id: bytes) -> int:
        """The put's version from the registry; a stale put is a refused object, counted."""
        stream = stream_id(req.key, provenance.request_id)
        try:
            version = await self.registry.claim(stream, state_id, req.version)
        except StaleState as exc:
            self.count_rejection(exc)
            raise
        self._remember_stream(state_id, stream)
        return version

    def _remember_stream(self, state_id: bytes, stream: bytes) -> None:
        self._issued[state_id] = stream
        if len(self._issued) > STREAMS_REMEMBERED:
            self._issued.popitem(last=False)

    async def _stream_of(self, state_id: bytes) -> bytes | None:
        """The stream ``state_id`` was issued for: remembered, or read from the registry."""
        stream = self._issued.get(state_id)
        if stream is not None:
            self._issued.move_to_end(state_id)
            return stream
        stream = await self.registry.stream_of(state_id)
        if stream is not None:
            self._remember_stream(state_id, stream)
        return stream

    def _check_put(self, req: PutRequest) -> None:
        self.tenancy.check_namespace(req.tenant, req.key.namespace)
        if req.publish and self.publish_tier is None and not self.options.tolerate_unpublished:
            raise Unavailable("publish requested but this daemon has no cross-node tier (Redis): nothing "
                              "was stored or published")
        if req.key.kind.name == "SSM" and req.key.token_start != 0:
            raise InvalidRequest("an SSM snapshot must start at token 0")

    def _stamp(self, prov: Provenance) -> Provenance:
        return Provenance(prov.request_id, prov.step, prov.producer_id or self.options.producer_id,
                          prov.created_at_ns or time.time_ns())

    async def hash_off_loop(self, nbytes: int, fn, *args, **kwargs):
        if nbytes < INLINE_HASH_BYTES or self.executor is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    # ---------------------------------------------------------------- loads

    async def load(self, req: LoadRequest, owner, *, expected: tuple[bytes, Expectation] | None = None) -> LoadResult:
        """``expected``: what ``expect_refs`` found for this load by ref, read ahead."""
        started = time.perf_counter()
        self.tenancy.check_namespace(req.tenant, req.namespace)
        if req.ref is not None:
            state_id, expectation = expected or await self._expect_ref(req)
            result = await self._load_object(state_id, expectation, owner, req.tenant, full_check=req.full_check)
        elif req.key is not None:
            result = await self._load_by_key(req, owner)
        else:
            raise InvalidRequest("a load names a ref or a key")
        if self.metrics is not None:
            self.metrics.observe_op(result.tier, result.header.key.kind.name.lower(), "load",
                                    result.payload.nbytes, time.perf_counter() - started)
        return result

    async def expect_refs(self, reqs: list[LoadRequest]) -> list[tuple[bytes, Expectation] | StatetierError | None]:
        """The registry reads of many loads by ref, made concurrently (``REGISTRY_READS_AT_ONCE``
        loads at a time): a batch of loads waits for a few round trips, not two per object.
        Each answer is ``load``'s ``expected``, the error reading it, or None (a load by key)."""
        out: list = [None] * len(reqs)

        async def read(index: int) -> None:
            try:
                out[index] = await self._expect_ref(reqs[index])
            except StatetierError as exc:
                out[index] = exc

        by_ref = [i for i, req in enumerate(reqs) if req.ref is not None]
        for start in range(0, len(by_ref), REGISTRY_READS_AT_ONCE):
            await asyncio.gather(*(read(i) for i in by_ref[start : start + REGISTRY_READS_AT_ONCE]))
        return out

    async def _expect_ref(self, req: LoadRequest) -> tuple[bytes, Expectation]:
        ref = req.ref
        key = ref.key if ref.key.namespace == req.namespace else dataclasses.replace(ref.key, namespace=req.namespace)
        # two independent registry reads (the second often remembered): one round trip's wait
        head, issued_for = await asyncio.gather(self.registry.newest(stream_id(key, ref.request_id)),
                                                self._stream_of(ref.state_id))
        return ref.state_id, Expectation.for_ref(
            ref, req.namespace, newest_version=head.version if head else None, state_id_stream=issued_for,
            tensors=req.tensors, allow_speculative=req.allow_speculative)

    async def _load_by_key(self, req: LoadRequest, owner) -> LoadResult:
        """The best valid candidate under the key: newest first, each one refused skipped and
        counted by ``skip_reason``; the first refusal is the answer when none is valid."""
        key = req.key if req.key.namespace == req.namespace else dataclasses.replace(req.key, namespace=req.namespace)
        candidates = await self.locate(key, allow_speculative=req.allow_speculative)
        refused: RejectedState | None = None
        for meta, _tier in candidates:
            head = await self.registry.newest(meta.stream_id)
            expectation = Expectation.for_key(key, newest_version=head.version if head else None,
                                              tensors=req.tensors, allow_speculative=req.allow_speculative)
            try:
                return await self._load_object(meta.object_id, expectation, owner, req.tenant, counted=False,
                                               full_check=req.full_check)
            except RejectedState as exc:
                self._count_skip(skip_reason(exc))
                refused = refused or exc
            except NotFound:
                continue  # gone since it was located
        if refused is not None:
            if not is_damage(refused):  # damage was counted where the copy was dropped
                self.count_rejection(refused)
            raise refused
        self._count_miss(key)
        raise NotFound("no stored object for that key")

    async def _load_object(self, state_id: bytes, expectation: Expectation, owner, tenant: str, *,
                           counted: bool = True, full_check: bool = False, may_wait: bool = True) -> LoadResult:
        """Serve the fastest copy that ``protocol.classify`` accepts. A damaged copy is removed
        (counted as damage) and the next copy tried; an intact copy of another identity is
        refused with its §4 reason, left where it is (see ``_serve``), and the next copy
        tried too: when one passes it is served and the refusal still counted, once. When
        none passes, the first identity refusal is the answer (the copies agree, so the
        request is what is wrong). ``counted=False`` counts a refusal as a skipped
        candidate (the caller tries the next candidate)."""
        damaged: RejectedState | None = None
        refused: RejectedState | None = None  # the first identity refusal, counted once per load
        unavailable: Unavailable | None = None
        for index, tier in enumerate(self.tiers):
            try:
                lease = await tier.prepare_load(state_id, owner=owner, ttl=self.options.lease_ttl)
            except NotFound:
                continue
            except Unavailable as exc:
                unavailable = unavailable or exc
                continue
            try:
                # the tensor specs a caller expects are checked apart: a mismatch is about the
                # request (a caller's buffer), not damage, and must not drop the copy
                bare = expectation if expectation.tensors is None else dataclasses.replace(expectation, tensors=None)
                result = await self._serve(tier, index, lease, state_id, bare, owner, tenant, full_check)
            except RejectedState as exc:
                if is_damage(exc):
                    self.count_rejection(exc)
                    await self.drop_copy(tier, state_id)
                    damaged = damaged or exc
                else:
                    refused = refused or exc
                continue
            except Unavailable as exc:
                unavailable = unavailable or exc
                continue
            if refused is not None:  # a copy above was another object: served from below, said
                self._count_refusal(refused, counted)
            return await self._check_specs(result, expectation, owner)
        if refused is not None:
            self._count_refusal(refused, counted)
            raise refused
        if damaged is not None:
            raise damaged
        if expectation.state_id_stream is not None and expectation.request_id is not None \
                and expectation.state_id_stream != stream_id(expectation.key, expectation.request_id):
            self.count_rejection(MisroutedState())
            raise MisroutedState(f"state_id {state_id.hex()} was issued for another stream")
        if expectation.newest_version is not None and expectation.version is not None \
                and expectation.newest_version > expectation.version:
            self.count_rejection(StaleState())
            raise StaleState(f"version {expectation.version} was superseded by {expectation.newest_version}")
        if unavailable is not None:
            raise unavailable
        if may_wait and self.placement.has_moves:  # its object may be between two tiers
            await self.placement.settle_moves()
            return await self._load_object(state_id, expectation, owner, tenant, counted=counted,
                                           full_check=full_check, may_wait=False)
        if counted:
            self._count_miss(expectation.key)
        raise NotFound(f"state {state_id.hex()} is in no tier")

    async def _check_specs(self, result: LoadResult, expectation: Expectation, owner) -> LoadResult:
        wanted = expectation.tensors
        found = tuple(t.spec for t in result.header.tensors)
        if wanted is None or found == tuple(wanted):
            return result
        await self.release(result.lease_id, owner)
        exc = CorruptPayload(f"tensors {[(s.name, s.dtype, s.shape) for s in found]} differ from the expected "
                             f"{[(s.name, s.dtype, s.shape) for s in wanted]}")
        self.count_rejection(exc)
        raise exc

    async def _serve(self, tier: Tier, index: int, lease: Lease, state_id: bytes, expectation: Expectation,
                     owner, tenant: str, full_check: bool = False) -> LoadResult:
        """Classify the leased copy found under ``state_id``; promote it when it came from
        below. Owns ``lease``.

        An authenticated object of another identity under this id (a connector that wrote
        to the wrong key) is refused and *left in place*: it is no damage (removing it
        could destroy the only copy of the state it really is), it can never be served
        under this id (every load classifies again), it is evidence for ``statetier
        inspect``, and it ages out with the tier's LRU or TTL like any object.
        """
        kept = False
        try:
            if index > 0 and self.options.promote_on_load and tier.reads_in_place:
                landed = await self._load_into_arena(tier, lease, state_id, expectation, owner, tenant, full_check)
                if landed is not None:
                    return landed
            blob = await tier.read(lease)
            # bytes in daemon-only memory were digested when sealed there; the client checks
            # the payload again where it lands (DESIGN §6)
            # (``full_check``: a client found a payload that did not match: digest every copy
            # again, so a damaged one is dropped and the next one served)
            trusted = (tier.verifies_on_read or tier.holds_verified_bytes) and not full_check
            with phase("open" if trusted else "open_and_hash"):
                opened = await self.hash_off_loop(0 if trusted else blob.nbytes, classify, blob, expectation,
                                                  self.keyring, stored_as=state_id, verify_payload=not trusted,
                                                  verified=self._verified if trusted else None)
            if self.metrics is not None:
                self.metrics.count_hit(tier.name, expectation.key.kind.name.lower())
            if index > 0 and self.options.promote_on_load:
                # the verified header says what this is, not the tier's index entry
                promoted = await self._promote(blob, ObjectMeta.from_header(opened.header), tier, owner, tenant)
                if promoted is not None:
                    lease_id, held = promoted
                    view = memoryview(await held.tier.read(held.lease)).cast("B")
                    return self._result(lease_id, held, opened.header, view)
            kept = True
            lease_id, held = self._hold(tier, lease, owner)
            return self._result(lease_id, held, opened.header, memoryview(blob).cast("B"))
        finally:
            if not kept:
                await tier.complete_load(lease)

    async def _load_into_arena(self, tier: Tier, lease: Lease, state_id: bytes, expectation: Expectation, owner,
                               tenant: str, full_check: bool) -> LoadResult | None:
        """A promotion read straight into its arena reservation (the tier's ``read_into``) and
        classified there: no fresh buffer, no copy (``tier.reads_in_place``). None when it cannot be promoted (no room,
        quota, a copy already above, or a header whose meta differs from the tier's index
        entry): the caller then reads it as usual. Damage and refusals raise as from ``read``."""
        target, meta = self.arena, lease.meta
        if target is None or self.tiers.index(target) > self.tiers.index(tier):
            return None
        trusted = tier.verifies_on_read and not full_check
        opened, filling = None, False

        async def fill(view: memoryview):
            nonlocal opened, filling
            filling = True
            with phase("read_into_arena"):
                await tier.read_into(lease, view)
            opened = await self.hash_off_loop(0 if trusted else view.nbytes, classify, view, expectation,
                                              self.keyring, stored_as=state_id, verify_payload=not trusted,
                                              verified=self._verified if trusted else None)
            # the verified header says what this is: kept only if the index entry agrees
            return opened if ObjectMeta.from_header(opened.header) == meta else None

        async with self.placement.cycle():
            if self.placement.is_deleting(meta.object_id) or await target.contains(meta.object_id) \
                    or self.tenancy.would_exceed(tenant, target.name, meta.size):
                return None
            try:
                if await self.placement.store_filled(target, meta, fill) is None:
                    return None
            except StatetierError as exc:
                if filling:
                    raise  # what the read or the classification found
                log.debug("promotion of %s into %s skipped: %s", meta.object_id.hex(), target.name, exc)
                return None  # no room in the arena (or a concurrent promotion won): read as usual
            self.tenancy.charge(tenant, target.name, meta.object_id, meta.size)
            held_lease = await target.prepare_load(meta.object_id, owner=owner, ttl=self.options.lease_ttl)
        if self.metrics is not None:
            self.metrics.count_hit(tier.name, expectation.key.kind.name.lower())
            self.metrics.count_promotion(tier.name, target.name)
        lease_id, held = self._hold(target, held_lease, owner)
        view = memoryview(await target.read(held_lease)).cast("B")
        return self._result(lease_id, held, opened.header, view)

    async def _promote(self, blob, meta: ObjectMeta, source: Tier, owner, tenant: str) -> tuple[int, _Held] | None:
        target = self.arena or self.tiers[0]
        if target is source or self.tiers.index(target) > self.tiers.index(source):
            return None
        oid = meta.object_id
        try:
            async with self.placement.cycle():
                if self.placement.is_deleting(oid):
                    return None
                # a copy already above was not the one served (it was refused, or is not yet
                # judged): serve what was verified, never an unjudged copy in its place
                if await target.contains(oid) or self.tenancy.would_exceed(tenant, target.name, meta.size):
                    return None
                await self.placement.store_in(target, [blob], meta)
                self.tenancy.charge(tenant, target.name, oid, meta.size)
                lease = await target.prepare_load(oid, owner=owner, ttl=self.options.lease_ttl)
        except StatetierError as exc:
            log.debug("promotion of %s into %s skipped: %s", meta.object_id.hex(), target.name, exc)
            return None
        if self.metrics is not None:
            self.metrics.count_promotion(source.name, target.name)
        return self._hold(target, lease, owner)

    def _result(self, lease_id: int, held: _Held, header, blob: memoryview) -> LoadResult:
        offset = None
        if held.tier is self.arena:
            offset = self.arena.arena_offset(held.lease) + header.header_len
        return LoadResult(header, blob[header.header_len :], lease_id, held.tier.name, offset, blob)

    def _hold(self, tier: Tier, lease: Lease, owner) -> tuple[int, _Held]:
        lease_id = next(self._ids)
        held = _Held(tier, lease, owner)
        self._held[lease_id] = held
        return lease_id, held

    async def drop_copy(self, tier: Tier, state_id: bytes) -> None:
        try:
            await tier.delete(state_id)
        except StatetierError as exc:
            log.warning("could not drop damaged copy %s from %s: %s", state_id.hex(), tier.name, exc)
        self.tenancy.refund(tier.name, state_id)

    def count_rejection(self, exc: StatetierError) -> None:
        if self.metrics is not None:
            self.metrics.count_rejection(exc.reason)

    def _count_refusal(self, exc: RejectedState, counted: bool) -> None:
        if counted:
            self.count_rejection(exc)
        else:
            self._count_skip(skip_reason(exc))

    def _count_skip(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count_skipped_candidate(reason)

    count_skip = _count_skip  # for daemon.lookup, which locates many keys at once

    def _count_miss(self, key: StateKey) -> None:
        if self.metrics is not None:
            self.metrics.count_miss(key.kind.name.lower())

    async def read_leased(self, lease_id: int, owner) -> memoryview:
        """The verified bytes behind a lease (used by lookup callers that load by lease)."""
        held = self._held_by(lease_id, owner)
        return await held.tier.read(held.lease)

    # ---------------------------------------------------------------- leases

    async def release(self, lease_id: int, owner) -> bool:
        held = self._held.get(lease_id)
        if held is None or held.owner != owner:
            return False
        del self._held[lease_id]
        await held.tier.complete_load(held.lease)
        return True

    async def release_owner(self, owner) -> int:
        mine = [lid for lid, held in self._held.items() if held.owner == owner]
        for lease_id in mine:
            await self.release(lease_id, owner)
        tickets = [tid for tid, (_, o) in self._reservations.items() if o == owner]
        for ticket_id in tickets:
            await self.abort(ticket_id, owner)
        return len(mine) + len(tickets)

    def _held_by(self, lease_id: int, owner) -> _Held:
        held = self._held.get(lease_id)
        if held is None or held.owner != owner:
            raise LeaseError(f"no lease {lease_id} on this connection")
        return held

    def hold_for_lookup(self, tier: Tier, lease: Lease, owner) -> int:
        return self._hold(tier, lease, owner)[0]

    # ---------------------------------------------------------------- lookup, delete, inspect

    async def lookup(self, req: LookupRequest, owner) -> LookupResult:
        started = time.perf_counter()
        self.tenancy.check_namespace(req.tenant, req.namespace)
        result = await joint_hit(self, req, owner)
        if self.metrics is not None:
            self.metrics.observe_lookup(result.tokens, time.perf_counter() - started)
        return result

    async def locate(self, key: StateKey, *, allow_speculative: bool = False) -> list[tuple[ObjectMeta, Tier]]:
        """Objects stored under ``key`` that may be served (the fastest tier holding each),
        newest first: superseded ones (``stale``) and, unless allowed, speculative snapshots
        (``speculative``) are skipped and counted. Tiers and the registry are asked
        concurrently."""
        digest = key.digest()
        answers = await asyncio.gather(*(tier.find_by_key(digest) for tier in self.tiers), return_exceptions=True)
        seen: dict[bytes, tuple[ObjectMeta, Tier]] = {}
        for tier, metas in zip(self.tiers, answers):
            if isinstance(metas, Unavailable):
                continue
            if isinstance(metas, BaseException):
                raise metas
            for meta in metas:
                seen.setdefault(meta.object_id, (meta, tier))
        heads = await asyncio.gather(*(self.registry.newest(meta.stream_id) for meta, _ in seen.values()))
        servable = []
        for (meta, tier), head in zip(seen.values(), heads):
            if head is not None and head.version > meta.version:
                self._count_skip("stale")
            elif meta.speculative and not allow_speculative:
                self._count_skip("speculative")
            else:
                servable.append((meta, tier))
        servable.sort(key=lambda item: (item[0].version, item[0].created_at_ns), reverse=True)
        return servable

    async def delete(self, tenant: str, ref: StateRef) -> int:
        """Remove every copy of ``ref``'s object; none is reachable once this returns.

        The tiers are swept under a tombstone (no move starts a copy meanwhile), every move
        begun before is waited for (an eviction may hold the object between two tiers),
        and the tiers are swept again for what such a move left behind.
        """
        self.tenancy.check_namespace(tenant, ref.key.namespace)
        async with self.placement.deleting(ref.state_id):
            deleted = await self._sweep(ref)
            await self.placement.settle_moves()
            deleted += await self._sweep(ref)
        return deleted

    async def _sweep(self, ref: StateRef) -> int:
        deleted = 0
        for tier in self.tiers:
            try:
                meta = await tier.get_meta(ref.state_id)
                if meta is not None and meta.key_digest != ref.key.digest():
                    raise Forbidden("that state_id does not belong to the given key")
                if await tier.delete(ref.state_id):
                    deleted += 1
                self.tenancy.refund(tier.name, ref.state_id)
            except Unavailable:
                continue
        return deleted

    async def inspect(self, tenant: str, state_id: bytes) -> dict:
        return await audit.inspect(self, tenant, state_id)

    async def verify_all(self, tenant: str | None = None, progress=None) -> dict:
        return await audit.verify_all(self, tenant, progress)

    # ---------------------------------------------------------------- stats

    def tier_stats(self):
        return [tier.stats() for tier in self.tiers]

    @property
    def lease_count(self) -> int:
        return len(self._held)

    @property
    def reservation_count(self) -> int:
        return len(self._reservations)

    def stats(self) -> dict:
        tiers = self.tier_stats()
        return {
            "tiers": [dataclasses.asdict(s) for s in tiers],
            "leases": len(self._held),
            "reservations": len(self._reservations),
            "objects": sum(s.objects for s in tiers),
            "write_behind_pending": self.placement.write_behind_pending,
            "dropped_on_demotion": self.placement.dropped,
            "tenants": self.tenancy.usage(),
        }

    def shared_memory(self) -> tuple[str, int] | None:
        if self.arena is None:
            return None
        return self.arena.shared_memory()


def _copy_then_seal(source, key, provenance, layout, payload, **options) -> bytes:
    if source is not None:
        payload[:] = source
    return seal(key, provenance, layout, payload, **options)


def _meta(req: PutRequest, provenance: Provenance, state_id: bytes, version: int, header_len: int,
          payload_len: int) -> ObjectMeta:
    return ObjectMeta(
        object_id=state_id, key_digest=req.key.digest(), stream_id=stream_id(req.key, provenance.request_id),
        version=version, kind=req.key.kind, size=header_len + payload_len, header_len=header_len,
        created_at_ns=provenance.created_at_ns, request_id=provenance.request_id, step=provenance.step,
        speculative=req.speculative)

