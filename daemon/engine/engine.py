"""The engine: the tier hierarchy behind the daemon's requests (DESIGN §4–6); its one entry point.

``Engine(tiers, keyring=, registry=, metrics=, options=, arena=, publishing=, write_behind_to=,
executor=, announcements=, batch_pulls=, write_behind_yields_to=)`` — ``tiers`` fastest first
(device, host, disk, redis; any may be absent); ``arena`` the host tier that puts are sealed
into (its reservations); ``publishing`` where a publish goes (``daemon.engine.publishing``: the
cross-node tier, the shared Redis tier, the purge marks it keeps); ``batch_pulls`` the tier that
pulls a load batch's copies at once (the peer tier: ``daemon.engine.pulls``);
``write_behind_yields_to`` what the write-behind waits on before each copy (the peer
server's ``quiet``: pulls first); ``announcements`` the KV events' view of every copy
(``daemon.engine.announcements``, observing ``Tenancy``: the events name the owned
namespaces), or None. It builds one ``daemon.engine.stack.Stack`` and composes the parts that
hold the rules; the server calls, per request, and the engine forwards to:

- ``put_batch`` (``put`` / ``put_shared``: a batch of one)   ``daemon.engine.puts`` (checks,
  version claims, reservations, sealing in one job, placement) and ``daemon.engine.handoff``
  (publish, durable copies, write-behind)
- ``load_batch`` (``load``: a batch of one)   ``daemon.engine.loads`` (by ref or by key),
  ``daemon.engine.fencing`` (one registry read for the batch), ``daemon.engine.serving``
  (copies fastest first, each judged and promoted; spec checks)
- ``lookup``, ``locate``         ``daemon.engine.lookup`` (the joint hit), ``daemon.engine.candidates``
- ``release`` / ``release_many`` / ``release_owner`` ``daemon.engine.leases`` (a connection
  went away: its leases)
- ``delete``                    ``daemon.engine.deletion``; ``inspect``, ``verify_all``: ``daemon.engine.audit``
- ``list_objects``, ``purge``    ``daemon.engine.catalog`` (what is stored per tenant and namespace;
  removing a namespace's or a tenant's objects from every tier)
- ``start`` / ``close``, ``stats``, ``lease_count``, ``lease_releases`` (asked, released)

While the version registry ``is_degraded`` (a shared one unreachable), every load, put and
lookup answered is counted as served during the outage (``statetier_outage_served_total``).

``EngineOptions`` (defined in ``daemon.engine.stack``) and ``Publishing`` are exported here. Eviction and demotion
are ``daemon.engine.placement``'s; tenant bytes follow every copy (``daemon.engine.tenancy``).
Every request is taken into its tenant's own namespaces first, a batch item by item
(``own_incoming``, ``own_load``, ``own_lookup``, ``owned_ref``: ``daemon.engine.tenancy``):
the refs it returns carry them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from concurrent.futures import Executor
from typing import Awaitable, Callable

from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.identity import Namespace, StateKey, StateRef
from statetier.protocol.keyring import Keyring
from statetier.tiers.base import ObjectMeta, Tier
from statetier.tiers.registry import VersionRegistry

from ..metrics import Metrics, NullMetrics, counted
from . import audit, candidates, catalog, deletion
from .announcements import Announcements
from .fencing import Fences
from .leases import Leases
from .loads import Loads
from .lookup import joint_hit
from .placement import Placement
from .pulls import PullsBatches
from .publishing import Publishing
from .purge_marks import PurgeMarks
from .puts import Puts
from ..requests import Incoming, JointHit, LoadRequest, LoadResult, LookupRequest, PutRequest, PutResult
from .stack import EngineOptions, Stack
from .tenancy import Tenancy, own_incoming, own_load, own_lookup, owned_namespace, owned_ref

__all__ = ["Engine", "EngineOptions", "Publishing"]

log = logging.getLogger("statetier.engine")


class Engine:
    def __init__(self, tiers: list[Tier], *, keyring: Keyring, registry: VersionRegistry,
                 metrics: Metrics | NullMetrics | None = None,
                 options: EngineOptions | None = None, arena: Tier | None = None,
                 publishing: Publishing | None = None,
                 write_behind_to: Tier | None = None, executor: Executor | None = None,
                 announcements: Announcements | None = None, batch_pulls: PullsBatches | None = None,
                 write_behind_yields_to: Callable[[float], Awaitable[bool]] | None = None) -> None:
        if not tiers:
            raise InvalidRequest("the engine needs at least one tier")
        self.tiers = list(tiers)
        self.keyring = keyring
        self.registry = registry
        self.metrics = metrics = NullMetrics() if metrics is None else metrics
        self.options = options or EngineOptions()
        self.arena = arena
        self.publishing = publishing = publishing or Publishing()
        self.executor = executor
        volatile = self.tiers[: self.tiers.index(write_behind_to)] if write_behind_to in self.tiers else []
        self.announcements = announcements
        self.tenancy = Tenancy(self.options.quotas, observer=announcements)
        self.placement = Placement(self.tiers, metrics, write_behind_limit=self.options.write_behind_limit,
                                   write_behind_from=volatile, write_behind_to=write_behind_to,
                                   tenancy=self.tenancy, yields_to=write_behind_yields_to)
        marks = publishing.marks  # declared by the composition root: the shared tier that keeps purge marks
        self.purges = PurgeMarks(marks.purge_marks, self.honour_purge_marks) if marks is not None else None
        # lookups and loads by key: the marks ride on their locate; loads by ref read them beside the registry
        self.stack = Stack(self.tiers, keyring, registry, self.options, self.placement, self.tenancy, metrics,
                           arena, publishing, executor, announcements, self.purges)
        self._leases = Leases(itertools.count(1))
        fences = Fences(self.stack)
        self._puts = Puts(self.stack, fences)
        self._loads = Loads(self.stack, fences, self._leases, self.purges, batch_pulls)
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
        for owner in self._leases.owners():
            await self.release_owner(owner)
        for tier in reversed(self.tiers):
            try:
                await tier.close()
            except StatetierError:
                log.exception("closing tier %s failed", tier.name)
        await self.registry.close()

    # ---------------------------------------------------------------- puts (``daemon.engine.puts``)

    async def put_batch(self, items: list[Incoming]) -> list[PutResult | StatetierError | None]:
        """Many puts as one unit of work: an answer per item, None after a failure (not attempted)."""
        answers = await self._puts.put_batch([own_incoming(item) for item in items])
        self._count_outage("put", answers)
        return answers

    async def put(self, req: PutRequest, payload) -> PutResult:
        return _one(await self.put_batch([Incoming(req, memoryview(payload).cast("B"))]))

    async def put_shared(self, req: PutRequest, source) -> PutResult:
        """Seal a payload that lies in memory its client can still write: copied first."""
        return _one(await self.put_batch([Incoming(req, memoryview(source).cast("B"), shared=True)]))

    # ---------------------------------------------------------------- loads (``daemon.engine.loads``)

    async def load_batch(self, reqs: list[LoadRequest], owner) -> list[LoadResult | StatetierError | None]:
        """Many loads as one unit of work: an answer per request, None after a failure."""
        answers = await self._loads.load_batch([own_load(req) for req in reqs], owner)
        self._count_outage("load", answers)
        return answers

    async def load(self, req: LoadRequest, owner) -> LoadResult:
        return _one(await self.load_batch([req], owner))

    async def release_many(self, lease_ids: list[int], owner) -> int:
        """Give back many leases at once; how many were still held."""
        return await self._leases.release_many(lease_ids, owner)

    # ---------------------------------------------------------------- leases (``daemon.engine.leases``)

    async def release(self, lease_id: int, owner) -> bool:
        return await self._leases.release(lease_id, owner)

    @property
    def lease_releases(self) -> tuple[int, int]:
        """(lease ids asked to be released, leases released) since start (``Leases``)."""
        return self._leases.asked, self._leases.released

    async def release_owner(self, owner) -> int:
        mine = self._leases.ids_of(owner)
        for lease_id in mine:
            await self.release(lease_id, owner)
        return len(mine)

    # ---------------------------------------------------------------- lookup, delete, inspect

    async def lookup(self, req: LookupRequest, owner) -> JointHit:
        started = time.perf_counter()
        req = own_lookup(req)
        self.tenancy.check_namespace(req.tenant, req.namespace)
        result = await joint_hit(self.stack, self._leases, req, owner)
        requested = req.boundaries[-1][0] if req.boundaries else 0
        self.metrics.observe_lookup(result.tokens, time.perf_counter() - started, requested)
        self._count_outage("lookup", [result])
        return result

    def _count_outage(self, op: str, answers: list) -> None:
        """Answers given while the shared registry is unreachable: from this daemon's own
        copies and versions (``tiers.tolerant_registry``), counted per op."""
        if self.registry.is_degraded:
            self.metrics.count_outage_served(op, sum(1 for a in answers if a is not None
                                                     and not isinstance(a, BaseException)))

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
        """What is stored, per (tenant, namespace); the cluster's purge marks honoured first, so
        another daemon's purge is never listed here (``purge_marks``)."""
        if self.purges is not None:
            await self.purges.before_serving()
        return await catalog.listing(self.stack, tenant, everyone=everyone)

    async def purge(self, tenant: str, *, namespace: Namespace | None = None, of_tenant: str | None = None,
                    is_operator: bool = False) -> dict:
        """A tenant's namespace is taken into the one it owns, as for every request; an
        operator names a stored (owned) namespace exactly, as ``statetier ls --all`` shows it."""
        if namespace is not None and not is_operator:
            namespace = owned_namespace(tenant, namespace)
        return await catalog.purge(self.stack, tenant, namespace=namespace, of_tenant=of_tenant,
                                   is_operator=is_operator)

    async def honour_purge_marks(self, marks: dict[str, int]) -> dict:
        """Remove the copies other daemons' purges marked in the shared registry (``catalog``)."""
        return await catalog.honour_marks(self.stack, marks)

    async def take_purge_marks(self, marks: dict[str, int]) -> None:
        """The marks the health probe read: the new ones honoured (``purge_marks.PurgeMarks``)."""
        if self.purges is not None:
            await self.purges.take(marks)

    async def inspect(self, tenant: str, state_id: bytes) -> dict:
        return await audit.inspect(self.stack, tenant, state_id)

    async def verify_all(self, tenant: str | None = None, progress=None) -> dict:
        return await audit.verify_all(self.stack, tenant, progress)

    # ---------------------------------------------------------------- stats

    def tier_stats(self):
        return [tier.stats() for tier in self.tiers]

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    def stats(self) -> dict:
        """The STATS reply's engine part: per tier its copies and usage, ``copies`` in all (an
        object in two tiers counts twice; ``list_objects`` counts objects), and ``counters``:
        what ``metrics.counted`` says was counted so far (hits, misses, rejections by reason, …)."""
        tiers = self.tier_stats()
        return {
            "tiers": [dataclasses.asdict(s) for s in tiers],
            "leases": len(self._leases),
            "copies": sum(s.objects for s in tiers),
            "counters": counted(self.metrics),
            "write_behind_pending": self.placement.write_behind_pending,
            "dropped_on_demotion": self.placement.dropped,
            "registry_heads_behind": self._fences.rollbacks_seen,
            "tenants": self.tenancy.usage(),
        }


def _one(answers: list):
    """The answer of a batch of one: its result, or its error raised."""
    (answer,) = answers
    if isinstance(answer, BaseException):
        raise answer
    return answer
