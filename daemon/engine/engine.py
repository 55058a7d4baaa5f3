"""The engine: the tier hierarchy behind the daemon's requests (DESIGN §4–6); its one entry point.

``Engine(tiers, keyring=, registry=, metrics=, options=, arena=, publish=, write_behind_to=,
executor=)`` — ``tiers`` fastest first (device, host, disk, redis; any may be absent);
``arena`` the host tier whose shared memory same-host clients map; ``publish`` the
cross-node tier (Redis). It builds one ``daemon.engine.stack.Stack`` and composes the parts that
hold the rules; the server calls, per request, and the engine forwards to:

- ``put`` / ``put_shared`` / ``reserve`` → ``commit`` / ``abort``   ``daemon.engine.puts`` (sealing,
  version claims, placement, publish, durable copies, reservations in the arena)
- ``expect_refs``, ``load``      ``daemon.engine.fencing`` (registry reads) and ``daemon.engine.loads``
  (copies fastest first, each judged and promoted by ``daemon.engine.serving``; spec checks)
- ``lookup``, ``locate``         ``daemon.engine.lookup`` (the joint hit), ``daemon.engine.candidates``
- ``release`` / ``release_owner`` ``daemon.engine.leases`` (a connection went away: its leases
  and open reservations)
- ``delete``, ``drop_copy``      ``daemon.engine.deletion``; ``inspect``, ``verify_all``: ``daemon.engine.audit``
- ``list_objects``, ``purge``    ``daemon.engine.catalog`` (what is stored per tenant and namespace;
  removing a namespace's or a tenant's objects from every tier)
- ``start`` / ``close``, ``stats``, ``lease_count``, ``reservation_count``, ``shared_memory``

``EngineOptions`` (defined in ``daemon.engine.stack``) is exported here. Eviction and demotion
are ``daemon.engine.placement``'s; tenant bytes follow every copy (``daemon.engine.tenancy``).
Every request is taken into its tenant's own namespaces first (``own_put``, ``own_load``,
``own_lookup``, ``owned_ref``: ``daemon.engine.tenancy``): the refs it returns carry them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from concurrent.futures import Executor

from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.identity import Namespace, StateKey, StateRef
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import Expectation
from statetier.tiers.base import Lease, ObjectMeta, Tier
from statetier.tiers.registry import VersionRegistry

from . import audit, candidates, catalog, deletion
from .fencing import Fences
from .leases import Leases
from .loads import Loads
from .lookup import joint_hit
from .placement import Placement
from .puts import Puts
from ..requests import LoadRequest, LoadResult, LookupRequest, LookupResult, PutRequest, PutResult, Reservation
from .stack import EngineOptions, Stack
from .tenancy import Tenancy, own_load, own_lookup, own_put, owned_namespace, owned_ref

__all__ = ["Engine", "EngineOptions"]

log = logging.getLogger("statetier.engine")


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
        self.stack = Stack(self.tiers, keyring, registry, self.options, self.placement, self.tenancy, metrics,
                           arena, publish, executor)
        ids = itertools.count(1)  # lease ids and reservation tickets: one counter, no id names two things
        self._leases = Leases(ids)
        fences = Fences(self.stack)
        self._puts = Puts(self.stack, fences, ids)
        self._loads = Loads(self.stack, fences, self._leases)
        self._fences = fences
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
        for owner in self._leases.owners() | self._puts.owners():
            await self.release_owner(owner)
        for tier in reversed(self.tiers):
            try:
                await tier.close()
            except StatetierError:
                log.exception("closing tier %s failed", tier.name)
        await self.registry.close()

    # ---------------------------------------------------------------- puts (``daemon.engine.puts``)

    async def put(self, req: PutRequest, payload) -> PutResult:
        return await self._puts.put(own_put(req), payload)

    async def reserve(self, req: PutRequest, owner) -> Reservation:
        return await self._puts.reserve(own_put(req), owner)

    async def put_shared(self, req: PutRequest, source, owner) -> PutResult:
        """Seal a payload that lies in memory its client can still write: copied first."""
        return await self._puts.put_shared(own_put(req), source, owner)

    async def commit(self, ticket_id: int, owner, source=None) -> PutResult:
        return await self._puts.commit(ticket_id, owner, source)

    async def abort(self, ticket_id: int, owner) -> None:
        await self._puts.abort(ticket_id, owner)

    async def hash_off_loop(self, nbytes: int, fn, *args, **kwargs):
        return await self.stack.hash_off_loop(nbytes, fn, *args, **kwargs)

    # ---------------------------------------------------------------- loads (``daemon.engine.loads``)

    async def load(self, req: LoadRequest, owner, *, expected: tuple[bytes, Expectation] | None = None) -> LoadResult:
        """``expected``: what ``expect_refs`` found for this load by ref, read ahead."""
        return await self._loads.load(own_load(req), owner, expected=expected)

    async def expect_refs(self, reqs: list[LoadRequest]) -> list[tuple[bytes, Expectation] | StatetierError | None]:
        """The registry reads of many loads by ref, made concurrently (``daemon.engine.fencing``)."""
        return await self._fences.expect_refs([own_load(req) for req in reqs])

    async def drop_copy(self, tier: Tier, state_id: bytes) -> None:
        await deletion.drop_copy(self.stack, tier, state_id)

    def count_rejection(self, exc: StatetierError) -> None:
        self.stack.count_rejection(exc)

    def count_skip(self, reason: str) -> None:  # for daemon.engine.lookup, which locates many keys at once
        self.stack.count_skip(reason)

    async def read_leased(self, lease_id: int, owner) -> memoryview:
        """The verified bytes behind a lease (used by lookup callers that load by lease)."""
        held = self._leases.held_by(lease_id, owner)
        return await held.tier.read(held.lease)

    # ---------------------------------------------------------------- leases (``daemon.engine.leases``)

    async def release(self, lease_id: int, owner) -> bool:
        return await self._leases.release(lease_id, owner)

    async def release_owner(self, owner) -> int:
        mine = self._leases.ids_of(owner)
        for lease_id in mine:
            await self.release(lease_id, owner)
        return len(mine) + await self._puts.abort_owner(owner)

    def hold_for_lookup(self, tier: Tier, lease: Lease, owner) -> int:
        return self._leases.hold(tier, lease, owner)[0]

    # ---------------------------------------------------------------- lookup, delete, inspect

    async def lookup(self, req: LookupRequest, owner) -> LookupResult:
        started = time.perf_counter()
        req = own_lookup(req)
        self.tenancy.check_namespace(req.tenant, req.namespace)
        result = await joint_hit(self, req, owner)
        if self.metrics is not None:
            requested = req.boundaries[-1][0] if req.boundaries else 0
            self.metrics.observe_lookup(result.tokens, time.perf_counter() - started, requested)
        return result

    async def locate(self, key: StateKey, *, allow_speculative: bool = False) -> list[tuple[ObjectMeta, Tier]]:
        """Objects stored under ``key`` that may be served (the fastest tier holding each),
        newest first: superseded ones (``stale``) and, unless allowed, speculative snapshots
        (``speculative``) are skipped and counted (``daemon.engine.candidates``)."""
        return await candidates.locate(self.stack, key, allow_speculative=allow_speculative)

    async def delete(self, tenant: str, ref: StateRef) -> int:
        """Remove every copy of ``ref``'s object; none is reachable once this returns
        (``daemon.engine.deletion``: swept, moves settled, swept again)."""
        return await deletion.delete(self.stack, tenant, owned_ref(tenant, ref))

    async def list_objects(self, tenant: str, *, everyone: bool = False) -> dict:
        return await catalog.listing(self.stack, tenant, everyone=everyone)

    async def purge(self, tenant: str, *, namespace: Namespace | None = None, of_tenant: str | None = None,
                    is_operator: bool = False) -> dict:
        """A tenant's namespace is taken into the one it owns, as for every request; an
        operator names a stored (owned) namespace exactly, as ``statetier ls --all`` shows it."""
        if namespace is not None and not is_operator:
            namespace = owned_namespace(tenant, namespace)
        return await catalog.purge(self.stack, tenant, namespace=namespace, of_tenant=of_tenant,
                                   is_operator=is_operator)

    async def inspect(self, tenant: str, state_id: bytes) -> dict:
        return await audit.inspect(self, tenant, state_id)

    async def verify_all(self, tenant: str | None = None, progress=None) -> dict:
        return await audit.verify_all(self, tenant, progress)

    # ---------------------------------------------------------------- stats

    def tier_stats(self):
        return [tier.stats() for tier in self.tiers]

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    @property
    def reservation_count(self) -> int:
        return len(self._puts)

    def stats(self) -> dict:
        tiers = self.tier_stats()
        return {
            "tiers": [dataclasses.asdict(s) for s in tiers],
            "leases": len(self._leases),
            "reservations": len(self._puts),
            "objects": sum(s.objects for s in tiers),
            "write_behind_pending": self.placement.write_behind_pending,
            "dropped_on_demotion": self.placement.dropped,
            "registry_heads_behind": self._fences.rollbacks_seen,
            "tenants": self.tenancy.usage(),
        }

    def shared_memory(self) -> tuple[str, int] | None:
        if self.arena is None:
            return None
        return self.arena.shared_memory()
