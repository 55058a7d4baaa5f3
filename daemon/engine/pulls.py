"""A load batch's objects that only a peer holds, pulled together before each is served.

- ``PullsBatches`` — what the tier that pulls a batch of its copies at once declares (the
  peer tier, named by the composition root): ``prepare_load`` / ``complete_load`` as every
  tier, and ``pull_many(pulls, landed)``.
- ``Pulled`` — one object of the batch, handed to the serve path (``daemon.engine.serving``):
  its lease on the pulling tier, the ``promotion`` whose arena reservation its bytes land in
  (None: a buffer of its own, when there is no free room), ``landed()`` → the bytes once
  they are there (raises what the pull met). Whoever ``claim``s it owns its lease and
  promotion.
- ``Prefetch(stack, puller)`` — one per load batch (``daemon.engine.loads``): ``start(reqs,
  expected, owner)`` leases each load by ref whose first copy is the puller's, reserves
  free arena room for it (``Placement.promote``: never an eviction) and pulls them all in
  one background task (one request per owner, the owners side by side), so the serve path
  lands object k while object k+1 is received; ``get(state_id)`` → its ``Pulled``;
  ``close()`` ends what no load claimed (the task cancelled, promotions completed False,
  leases released).

Loads by key, full checks (``full_check``: every copy digested) and objects a faster tier
holds are served as before, one pull each where they come from a peer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from statetier.protocol.errors import PeerLost, StatetierError
from statetier.tiers.base import Lease, Tier

from ..requests import LoadRequest
from .promotion import Promotion
from .stack import Stack


class PullsBatches(Protocol):
    """A tier that pulls many of its copies in one go (``tiers.peer.PeerTier``)."""

    async def prepare_load(self, object_id: bytes, owner: object = None, ttl: float | None = None) -> Lease: ...

    async def complete_load(self, lease: Lease) -> None: ...

    async def pull_many(self, pulls: Sequence[tuple[Lease, memoryview]], landed) -> None: ...


@dataclass(slots=True)
class Pulled:
    """See the module docstring."""

    tier: Tier
    lease: Lease
    promotion: Promotion | None
    view: memoryview
    outcome: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    claimed: bool = False

    def claim(self) -> bool:
        """True once: the caller then owns the lease and the promotion."""
        claimed, self.claimed = self.claimed, True
        return not claimed

    async def landed(self) -> memoryview:
        error = await asyncio.shield(self.outcome)
        if error is not None:
            raise error
        return self.view

    def settle(self, error: StatetierError | None) -> None:
        if not self.outcome.done():
            self.outcome.set_result(error)


class Prefetch:
    def __init__(self, stack: Stack, puller: PullsBatches) -> None:
        self.stack = stack
        self.puller = puller
        self._pulled: dict[bytes, Pulled] = {}
        self._task: asyncio.Task | None = None

    async def start(self, reqs: list[LoadRequest], expected: list, owner: object) -> None:
        stack = self.stack
        tier = next(t for t in stack.tiers if id(t) == id(self.puller))  # the same object, as a Tier
        mark = stack.placement.delete_mark  # before any copy is leased, as a load's own
        for req, expectation in zip(reqs, expected):
            if req.ref is None or expectation is None or isinstance(expectation, StatetierError) \
                    or req.full_check or req.ref.state_id in self._pulled:
                continue
            try:
                stack.tenancy.check_namespace(req.tenant, req.namespace)
                pulled = await self._lease(tier, req.ref.state_id, req.tenant, owner, mark)
            except StatetierError:
                continue  # the serve path meets it itself
            if pulled is not None:
                self._pulled[req.ref.state_id] = pulled
        if self._pulled:
            pulls = list(self._pulled.values())
            self._task = asyncio.create_task(self._pull(pulls), name="pull-batch")

    async def _lease(self, tier: Tier, object_id: bytes, tenant: str, owner: object, mark: int) -> Pulled | None:
        """The copy leased on ``tier`` with room for it, when no faster tier holds one."""
        stack = self.stack
        for faster in stack.tiers[: stack.tiers.index(tier)]:
            if await faster.contains(object_id):
                return None
        lease = await tier.prepare_load(object_id, owner=owner, ttl=stack.options.lease_ttl)
        promotion = None
        try:
            if stack.options.promote_on_load:
                promotion = await stack.placement.promote(tier, lease, stack.arena or stack.tiers[0], tenant=tenant,
                                                          delete_mark=mark)
        except BaseException:
            await tier.complete_load(lease)
            raise
        view = promotion.ticket.view if promotion is not None else None
        return Pulled(tier, lease, promotion, view if view is not None else memoryview(bytearray(lease.meta.size)))

    async def _pull(self, pulls: list[Pulled]) -> None:
        try:
            await self.puller.pull_many([(p.lease, p.view) for p in pulls], lambda i, error: pulls[i].settle(error))
        finally:
            for p in pulls:  # never left waiting: what did not land is lost with the batch
                p.settle(PeerLost("the batch's pull ended before this object landed"))

    def get(self, state_id: bytes) -> Pulled | None:
        return self._pulled.get(state_id)

    async def close(self) -> None:
        if self._task is not None:
            if not self._task.done():
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for pulled in self._pulled.values():
            if pulled.claim():
                try:
                    if pulled.promotion is not None:
                        await pulled.promotion.complete(False, owner=None, ttl=None)
                finally:
                    await pulled.tier.complete_load(pulled.lease)
        self._pulled.clear()
