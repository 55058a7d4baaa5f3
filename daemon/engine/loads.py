"""The load path: what each load expects, then the first copy that passes, served.

``Loads(stack, fences, leases, purges, puller)`` — one per engine; ``Engine.load_batch`` forwards here:

- ``load_batch(reqs, owner)`` → per request, in order, a ``LoadResult`` leased to ``owner``
  until released, its ``StatetierError``, or None (not attempted: a load before it failed).
  What the loads by ref expect is read from the registry in one call
  (``Fences.expect_refs``), beside it the cluster's purge marks (``purges``, when a shared
  tier keeps them: a new one's copies are removed before any is located); each load is then
  served by ref or by key (the best valid candidate of ``daemon.engine.candidates.locate``,
  newest first, each refusal skipped and counted); one metric update for the batch. A single load is a batch of one.
  With a ``puller`` (the peer tier), the batch's loads by ref that only a peer holds are
  pulled first, together (``daemon.engine.pulls.Prefetch``: one request per owner), and each
  is served from where it landed.

Each object is served by ``daemon.engine.serving.CopyServer.load``: its copies fastest tier
first, each judged by ``protocol.classify``, a damaged one dropped and the next tried, the
caller's tensor specs checked apart, after (see there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from statetier.protocol.classify import is_damage, skip_reason
from statetier.protocol.errors import InvalidRequest, NotFound, RejectedState, StatetierError

from .candidates import locate
from .fencing import Fences
from .leases import Leases
from .pulls import Prefetch, PullsBatches
from .purge_marks import PurgeMarks
from ..requests import LoadRequest, LoadResult
from .serving import CopyServer, Wanted
from .stack import Stack


class Loads:
    def __init__(self, stack: Stack, fences: Fences, leases: Leases, purges: PurgeMarks | None = None,
                 puller: PullsBatches | None = None) -> None:
        self.stack = stack
        self.puller = puller
        self.fences = fences
        self.leases = leases
        self.purges = purges
        self.copies = CopyServer(stack, leases)

    async def load_batch(self, reqs: list[LoadRequest], owner) -> list[LoadResult | StatetierError | None]:
        started, stack = time.perf_counter(), self.stack
        out: list[LoadResult | StatetierError | None] = [None] * len(reqs)
        expected = await self._expect(reqs)
        prefetch = await self._prefetch(reqs, expected, owner)
        try:
            for index, (req, expectation) in enumerate(zip(reqs, expected)):
                try:
                    stack.tenancy.check_namespace(req.tenant, req.namespace)
                    if isinstance(expectation, StatetierError):
                        raise expectation
                    if expectation is not None:
                        assert req.ref is not None  # only a load by ref has an expectation here
                        pulled = prefetch.get(req.ref.state_id) if prefetch is not None else None
                        out[index] = await self.copies.load_object(Wanted(
                            req.ref.state_id, expectation, owner, req.tenant, req.full_check, req.layers,
                            stack.placement.delete_mark, pulled))
                    elif req.key is not None:
                        out[index] = await self._load_by_key(req, owner)
                    else:
                        raise InvalidRequest("a load names a ref or a key")
                except StatetierError as exc:
                    out[index] = exc
                    break
        finally:
            if prefetch is not None:
                await prefetch.close()
        self._observe([r for r in out if isinstance(r, LoadResult)], started)
        return out

    async def _prefetch(self, reqs: list[LoadRequest], expected: list, owner) -> Prefetch | None:
        """The batch's loads that only a peer holds, being pulled together (see ``pulls``)."""
        if self.puller is None or len(reqs) < 2:
            return None
        prefetch = Prefetch(self.stack, self.puller)
        try:
            await prefetch.start(reqs, expected, owner)
        except BaseException:
            await prefetch.close()
            raise
        return prefetch

    async def _expect(self, reqs: list[LoadRequest]) -> list:
        """What each load by ref expects; meanwhile (one round trip each, side by side) the
        cluster's new purge marks honoured, before any copy is located."""
        if self.purges is None:
            return await self.fences.expect_refs(reqs)
        expected, _ = await asyncio.gather(self.fences.expect_refs(reqs), self.purges.before_serving())
        return expected

    def _observe(self, results: list[LoadResult], started: float) -> None:
        """One metric update for a batch's loads (per tier and kind)."""
        if not results:
            return
        seconds = (time.perf_counter() - started) / len(results)
        groups: dict[tuple[str, str], list[int]] = {}
        for result in results:
            group = groups.setdefault((result.tier, result.header.key.kind.name.lower()), [0, 0])
            group[0] += 1
            group[1] += result.payload.nbytes
        metrics = self.stack.metrics
        assert metrics is not None  # the caller observes only with metrics
        for (tier, kind), (count, nbytes) in groups.items():
            metrics.observe_ops(tier, kind, "load", count, nbytes, seconds)

    async def _load_by_key(self, req: LoadRequest, owner) -> LoadResult:
        """The best valid candidate under the key: newest first, each one refused skipped and
        counted by ``skip_reason``; the first refusal is the answer when none is valid."""
        stack = self.stack
        assert req.key is not None  # the caller checked
        key = req.key if req.key.namespace == req.namespace else dataclasses.replace(req.key, namespace=req.namespace)
        mark = stack.placement.delete_mark  # before any candidate is located or leased
        candidates = await locate(stack, key, allow_speculative=req.allow_speculative)
        refused: RejectedState | None = None
        refused_id = None
        for meta, _tier in candidates:
            expectation = await self.fences.expect_key(key, meta.stream_id, req)
            try:
                wanted = Wanted(meta.object_id, expectation, owner, req.tenant, req.full_check, req.layers, mark)
                return await self.copies.load_object(wanted, counted=False)
            except RejectedState as exc:
                stack.count_skip(skip_reason(exc))
                if refused is None:
                    refused, refused_id = exc, meta.object_id
            except NotFound:
                continue  # gone since it was located
        if refused is not None:
            if not is_damage(refused):  # damage was counted where the copy was dropped
                stack.count_rejection(refused, refused_id)
            raise refused
        stack.count_miss(key)
        raise NotFound("no stored object for that key")
