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
- ``load(req, owner)``                  find, verify in DESIGN §4 order, promote; the
                                        result stays leased until ``release(lease_id)``. A
                                        copy in daemon-only memory (host, device) is not
                                        digested again: the client verifies the payload
                                        where it lands (DESIGN §6)
- ``lookup(req, owner)``                the joint hit (``daemon.lookup``)
- ``release(lease_id, owner)`` / ``release_owner(owner)`` (a connection went away)
- ``delete(tenant, ref)``, ``inspect(state_id)``, ``verify_all()``, ``stats()``

Rules kept here: a put becomes visible only when sealed and complete; the version
registry fences stale puts and loads; a copy that fails an integrity check is removed and
the load falls through to the next copy, never to unverified bytes; identity mismatches
are refused outright; eviction demotes (``daemon.placement``); ``publish`` writes through
to the cross-node tier before the put returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field

from statetier.protocol.errors import (
    BadSignature,
    CapacityError,
    CorruptPayload,
    Forbidden,
    InvalidRequest,
    LeaseError,
    MalformedState,
    MisroutedState,
    NotFound,
    RejectedState,
    StaleState,
    StatetierError,
    TruncatedState,
    Unavailable,
    UnsupportedFormat,
)
from statetier.protocol.identity import Provenance, StateKey, StateRef, new_state_id, stream_id
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import (
    Expectation,
    VerifiedHeaders,
    decode_header,
    header_length,
    layout_payload,
    open_sealed,
    seal,
)
from statetier.tiers.base import Lease, ObjectMeta, Tier
from statetier.tiers.registry import VersionRegistry

from .lookup import joint_hit
from .placement import Placement
from .trace import phase
from .requests import LoadRequest, LoadResult, LookupRequest, LookupResult, PutRequest, PutResult, Reservation
from .tenancy import Tenancy

log = logging.getLogger("statetier.engine")

#: A copy failing one of these is damaged and removed; other rejections are about the request.
INTEGRITY_FAILURES = (TruncatedState, MalformedState, BadSignature, UnsupportedFormat, CorruptPayload)
#: Below this many bytes hashing inline beats a hop to the executor.
INLINE_HASH_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class EngineOptions:
    lease_ttl: float = 30.0
    producer_id: str = ""
    quotas: dict = field(default_factory=dict)  # tenant -> {tier name -> bytes}
    write_behind_limit: int = 256
    promote_on_load: bool = True


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
        self.placement = Placement(self.tiers, metrics, write_behind_limit=self.options.write_behind_limit,
                                   write_behind_from=volatile, write_behind_to=write_behind_to)
        self.tenancy = Tenancy(self.options.quotas)
        self._ids = itertools.count(1)
        self._held: dict[int, _Held] = {}
        self._reservations: dict[int, tuple[Reservation, object]] = {}
        self._verified = VerifiedHeaders()  # headers of hot objects: signature checked once
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
            header = await self._hash_off_loop(view.nbytes, seal, req.key, provenance, layout, view,
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
        private = await self._hash_off_loop(view.nbytes, bytes, view)
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
                header = await self._hash_off_loop(
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
        if req.publish and self.publish_tier is not None and tier is not self.publish_tier:
            if chunks is None:  # zero-copy put: the object lives only in the arena
                await self.placement.copy_between(meta.object_id, tier, self.publish_tier)
            else:
                await self.placement.store_in(self.publish_tier, chunks, meta)
        else:
            self.placement.schedule_copy_down(meta.object_id, tier)
        if req.publish and self.publish_tier is None:
            log.debug("publish requested but no cross-node tier is configured")
        if self.metrics is not None:
            self.metrics.observe_op(tier.name, meta.kind.name.lower(), "put", meta.size, time.perf_counter() - started)
        ref = StateRef(req.key, meta.request_id, meta.step, meta.object_id, meta.version)
        return PutResult(ref, tier.name)

    async def _claim(self, req: PutRequest, provenance: Provenance, state_id: bytes) -> int:
        """The put's version from the registry; a stale put is a refused object, counted."""
        try:
            return await self.registry.claim(stream_id(req.key, provenance.request_id), state_id, req.version)
        except StaleState as exc:
            self._count_rejection(exc)
            raise

    def _check_put(self, req: PutRequest) -> None:
        self.tenancy.check_namespace(req.tenant, req.key.namespace)
        if req.key.kind.name == "SSM" and req.key.token_start != 0:
            raise InvalidRequest("an SSM snapshot must start at token 0")

    def _stamp(self, prov: Provenance) -> Provenance:
        return Provenance(prov.request_id, prov.step, prov.producer_id or self.options.producer_id,
                          prov.created_at_ns or time.time_ns())

    async def _hash_off_loop(self, nbytes: int, fn, *args, **kwargs):
        if nbytes < INLINE_HASH_BYTES or self.executor is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    # ---------------------------------------------------------------- loads

    async def load(self, req: LoadRequest, owner) -> LoadResult:
        started = time.perf_counter()
        self.tenancy.check_namespace(req.tenant, req.namespace)
        if req.ref is not None:
            state_id, expectation = await self._expect_ref(req)
        elif req.key is not None:
            state_id, expectation = await self._expect_key(req)
        else:
            raise InvalidRequest("a load names a ref or a key")
        result = await self._load_object(state_id, expectation, owner)
        if self.metrics is not None:
            self.metrics.observe_op(result.tier, expectation.key.kind.name.lower(), "load",
                                    result.payload.nbytes, time.perf_counter() - started)
        return result

    async def _expect_ref(self, req: LoadRequest) -> tuple[bytes, Expectation]:
        ref = req.ref
        key = ref.key if ref.key.namespace == req.namespace else dataclasses.replace(ref.key, namespace=req.namespace)
        head = await self.registry.newest(stream_id(key, ref.request_id))
        issued_for = await self.registry.stream_of(ref.state_id)
        return ref.state_id, Expectation.for_ref(
            ref, req.namespace, newest_version=head.version if head else None, state_id_stream=issued_for,
            tensors=req.tensors, allow_speculative=req.allow_speculative)

    async def _expect_key(self, req: LoadRequest) -> tuple[bytes, Expectation]:
        key = req.key if req.key.namespace == req.namespace else dataclasses.replace(req.key, namespace=req.namespace)
        candidates = await self.candidates(key)
        if not candidates:
            self._count_miss(key)
            raise NotFound("no stored object for that key")
        meta = candidates[0]
        head = await self.registry.newest(meta.stream_id)
        return meta.object_id, Expectation.for_key(
            key, newest_version=head.version if head else None, tensors=req.tensors,
            allow_speculative=req.allow_speculative)

    async def _load_object(self, state_id: bytes, expectation: Expectation, owner) -> LoadResult:
        damaged: RejectedState | None = None
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
                result = await self._serve(tier, index, lease, bare, owner)
            except INTEGRITY_FAILURES as exc:
                self._count_rejection(exc)
                await self._drop_copy(tier, state_id)
                damaged = damaged or exc
            except RejectedState as exc:
                self._count_rejection(exc)
                raise
            except Unavailable as exc:
                unavailable = unavailable or exc
            else:
                return await self._check_specs(result, expectation, owner)
        if damaged is not None:
            raise damaged
        if expectation.state_id_stream is not None and expectation.request_id is not None \
                and expectation.state_id_stream != stream_id(expectation.key, expectation.request_id):
            self._count_rejection(MisroutedState())
            raise MisroutedState(f"state_id {state_id.hex()} was issued for another stream")
        if expectation.newest_version is not None and expectation.version is not None \
                and expectation.newest_version > expectation.version:
            self._count_rejection(StaleState())
            raise StaleState(f"version {expectation.version} was superseded by {expectation.newest_version}")
        if unavailable is not None:
            raise unavailable
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
        self._count_rejection(exc)
        raise exc

    async def _serve(self, tier: Tier, index: int, lease: Lease, expectation: Expectation, owner) -> LoadResult:
        """Verify the leased copy; promote it when it came from below. Owns ``lease``."""
        kept = False
        try:
            blob = await tier.read(lease)
            # bytes in daemon-only memory were digested when sealed there; the client checks
            # the payload again where it lands (DESIGN §6)
            trusted = tier.verifies_on_read or tier.holds_verified_bytes
            with phase("open" if trusted else "open_and_hash"):
                opened = await self._hash_off_loop(0 if trusted else blob.nbytes, open_sealed, blob, expectation,
                                                   self.keyring, verify_payload=not trusted,
                                                   verified=self._verified if trusted else None)
            if self.metrics is not None:
                self.metrics.count_hit(tier.name, expectation.key.kind.name.lower())
            if index > 0 and self.options.promote_on_load:
                promoted = await self._promote(blob, lease.meta, tier, owner)
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

    async def _promote(self, blob, meta: ObjectMeta, source: Tier, owner) -> tuple[int, _Held] | None:
        target = self.arena or self.tiers[0]
        if target is source or self.tiers.index(target) > self.tiers.index(source):
            return None
        try:
            if not await target.contains(meta.object_id):
                await self.placement.store_in(target, [blob], meta)
            lease = await target.prepare_load(meta.object_id, owner=owner, ttl=self.options.lease_ttl)
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

    async def _drop_copy(self, tier: Tier, state_id: bytes) -> None:
        try:
            await tier.delete(state_id)
        except StatetierError as exc:
            log.warning("could not drop damaged copy %s from %s: %s", state_id.hex(), tier.name, exc)
        self.tenancy.refund(tier.name, state_id)

    def _count_rejection(self, exc: StatetierError) -> None:
        if self.metrics is not None:
            self.metrics.count_rejection(exc.reason)

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

    async def candidates(self, key: StateKey) -> list[ObjectMeta]:
        """Fresh objects stored under ``key`` in any tier, newest first, with their tier."""
        found = await self.locate(key)
        return [meta for meta, _tier in found]

    async def locate(self, key: StateKey) -> list[tuple[ObjectMeta, Tier]]:
        """Objects stored under ``key`` in any tier (the fastest tier holding each), minus
        superseded ones, newest first. Tiers and the registry are asked concurrently."""
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
        fresh = [(meta, tier) for (meta, tier), head in zip(seen.values(), heads)
                 if head is None or head.version <= meta.version]
        fresh.sort(key=lambda item: (item[0].version, item[0].created_at_ns), reverse=True)
        return fresh

    async def delete(self, tenant: str, ref: StateRef) -> int:
        self.tenancy.check_namespace(tenant, ref.key.namespace)
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

    async def inspect(self, state_id: bytes) -> dict:
        tiers, header = [], None
        for tier in self.tiers:
            try:
                lease = await tier.prepare_load(state_id, owner="inspect")
            except (NotFound, Unavailable):
                continue
            try:
                tiers.append(tier.name)
                if header is None:
                    header = decode_header(await tier.read(lease)).describe()
            except StatetierError as exc:
                header = header or {"error": exc.reason, "message": exc.message}
            finally:
                await tier.complete_load(lease)
        if not tiers:
            raise NotFound(f"state {state_id.hex()} is in no tier")
        return {"header": header, "tiers": tiers}

    async def verify_all(self, progress=None) -> dict:
        """Re-check every object in every tier; drop what fails (``statetier verify``)."""
        report = {"checked": 0, "dropped": 0, "by_reason": {}}
        metas = []
        for tier in self.tiers:
            try:
                async for meta in tier.iter_objects():
                    metas.append((tier, meta))
            except Unavailable:
                continue
        for done, (tier, meta) in enumerate(metas, 1):
            await self._verify_one(tier, meta, report)
            if progress is not None:
                progress(done, len(metas))
        return report

    async def _verify_one(self, tier: Tier, meta: ObjectMeta, report: dict) -> None:
        try:
            lease = await tier.prepare_load(meta.object_id, owner="verify")
        except (NotFound, Unavailable):
            return
        report["checked"] += 1
        try:
            blob = await tier.read(lease)
            await self._hash_off_loop(blob.nbytes, open_sealed, blob, None, self.keyring)
        except RejectedState as exc:
            report["dropped"] += 1
            report["by_reason"][exc.reason] = report["by_reason"].get(exc.reason, 0) + 1
            self._count_rejection(exc)
            await tier.complete_load(lease)
            await self._drop_copy(tier, meta.object_id)
            return
        await tier.complete_load(lease)

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
        created_at_ns=provenance.created_at_ns, request_id=provenance.request_id, step=provenance.step)

