"""The load path: find, verify in DESIGN §4 order, serve the first copy that passes.

``Loads(stack, fences, leases, purges)`` — one per engine; ``Engine.load_batch`` forwards here:

- ``load_batch(reqs, owner)`` → per request, in order, a ``LoadResult`` leased to ``owner``
  until released, its ``StatetierError``, or None (not attempted: a load before it failed).
  What the loads by ref expect is read from the registry in one call
  (``Fences.expect_refs``), beside it the cluster's purge marks (``purges``, when a shared
  tier keeps them: a new one's copies are removed before any is located); each load is then
  served by ref or by key (the best valid candidate of ``daemon.engine.candidates.locate``,
  newest first, each refusal skipped and counted); one metric update for the batch. A single load is a batch of one.

Each copy, fastest tier first, is served by ``daemon.engine.serving.CopyServer`` and judged by
``protocol.classify`` (a hit is counted, for the tier that held the copy, only once a copy is
handed over: never for a refusal, of the copy or of the caller's tensor specs): a damaged copy is dropped
(``daemon.engine.deletion.drop_copy``) and the
next tried, never unverified bytes; an intact copy of another identity is refused with its
§4 reason, left in place, and the next tried. The tensor specs a caller expects are checked
apart, after (of a group object, those of the layers asked for): a mismatch is about
the request, not damage. A load that finds its object in
no tier while moves are under way settles them and looks again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from statetier.protocol.classify import is_damage, skip_reason
from statetier.protocol.errors import (
    DestinationMismatch,
    InvalidRequest,
    MisroutedState,
    NotFound,
    RejectedState,
    StaleState,
    StatetierError,
    Unavailable,
)
from statetier.protocol.groups import chosen
from statetier.protocol.identity import stream_id
from statetier.protocol.sealed import Expectation
from statetier.tiers.base import Tier

from .candidates import locate
from .deletion import drop_copy
from .fencing import Fences
from .leases import Leases
from .purge_marks import PurgeMarks
from ..requests import LoadRequest, LoadResult
from .serving import CopyServer, Wanted
from .stack import Stack


@dataclass(slots=True)
class _Passed:
    """Why the copies tried so far were passed over: the first of each kind."""

    damaged: RejectedState | None = None
    refused: RejectedState | None = None  # the first identity refusal, counted once per load
    unavailable: Unavailable | None = None


class Loads:
    def __init__(self, stack: Stack, fences: Fences, leases: Leases, purges: PurgeMarks | None = None) -> None:
        self.stack = stack
        self.fences = fences
        self.leases = leases
        self.purges = purges
        self.copies = CopyServer(stack, leases)

    async def load_batch(self, reqs: list[LoadRequest], owner) -> list[LoadResult | StatetierError | None]:
        started, stack = time.perf_counter(), self.stack
        out: list[LoadResult | StatetierError | None] = [None] * len(reqs)
        expected = await self._expect(reqs)
        for index, (req, expectation) in enumerate(zip(reqs, expected)):
            try:
                stack.tenancy.check_namespace(req.tenant, req.namespace)
                if isinstance(expectation, StatetierError):
                    raise expectation
                if expectation is not None:
                    assert req.ref is not None  # only a load by ref has an expectation here
                    out[index] = await self._load_object(Wanted(req.ref.state_id, expectation, owner, req.tenant,
                                                                req.full_check, req.layers,
                                                                stack.placement.delete_mark))
                elif req.key is not None:
                    out[index] = await self._load_by_key(req, owner)
                else:
                    raise InvalidRequest("a load names a ref or a key")
            except StatetierError as exc:
                out[index] = exc
                break
        self._observe([r for r in out if isinstance(r, LoadResult)], started)
        return out

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
        for meta, _tier in candidates:
            expectation = await self.fences.expect_key(key, meta.stream_id, req)
            try:
                wanted = Wanted(meta.object_id, expectation, owner, req.tenant, req.full_check, req.layers, mark)
                return await self._load_object(wanted, counted=False)
            except RejectedState as exc:
                stack.count_skip(skip_reason(exc))
                refused = refused or exc
            except NotFound:
                continue  # gone since it was located
        if refused is not None:
            if not is_damage(refused):  # damage was counted where the copy was dropped
                stack.count_rejection(refused)
            raise refused
        stack.count_miss(key)
        raise NotFound("no stored object for that key")

    async def _load_object(self, wanted: Wanted, *, counted: bool = True, may_wait: bool = True) -> LoadResult:
        """Serve the fastest copy that ``protocol.classify`` accepts. A damaged copy is removed
        (counted as damage) and the next copy tried; an intact copy of another identity is
        refused with its §4 reason, left where it is (see ``CopyServer.serve``), and the next
        copy tried too: when one passes it is served and the refusal still counted, once. When
        none passes, the first identity refusal is the answer (the copies agree, so the
        request is what is wrong). ``counted=False`` counts a refusal as a skipped
        candidate (the caller tries the next candidate)."""
        stack, passed = self.stack, _Passed()
        for index, tier in enumerate(stack.tiers):
            result = await self._try_copy(tier, index, wanted, passed)
            if result is None:
                continue
            if passed.refused is not None:  # a copy above was another object: served from below, said
                self._count_refusal(passed.refused, counted)
            result = await self._check_specs(result, wanted)
            # a hit only now: the bytes are the caller's
            stack.metrics.count_hit(tier.name, wanted.expectation.key.kind.name.lower())
            return result
        if passed.refused is not None:
            self._count_refusal(passed.refused, counted)
            raise passed.refused
        if passed.damaged is not None:
            raise passed.damaged
        self._raise_if_fenced(wanted.state_id, wanted.expectation)
        if passed.unavailable is not None:
            raise passed.unavailable
        if may_wait and stack.placement.has_moves:  # its object may be between two tiers
            await stack.placement.settle_moves()
            return await self._load_object(wanted, counted=counted, may_wait=False)
        if counted:
            stack.count_miss(wanted.expectation.key)
        raise NotFound(f"state {wanted.state_id.hex()} is in no tier{_no_shared_tier_hint(stack)}")

    async def _try_copy(self, tier: Tier, index: int, wanted: Wanted, passed: _Passed) -> LoadResult | None:
        """``tier``'s copy served, or None with why it was passed over noted in ``passed``."""
        try:
            lease = await tier.prepare_load(wanted.state_id, owner=wanted.owner, ttl=self.stack.options.lease_ttl)
        except NotFound:
            return None
        except Unavailable as exc:
            passed.unavailable = passed.unavailable or exc
            return None
        try:
            return await self.copies.serve(tier, index, lease, wanted)
        except RejectedState as exc:
            if is_damage(exc):
                if passed.damaged is None:  # once per load: a promoted copy carries its source's damage
                    self.stack.count_rejection(exc)
                await drop_copy(self.stack, tier, wanted.state_id)
                passed.damaged = passed.damaged or exc
            else:
                passed.refused = passed.refused or exc
        except Unavailable as exc:
            passed.unavailable = passed.unavailable or exc
        return None

    def _raise_if_fenced(self, state_id: bytes, expectation: Expectation) -> None:
        """No copy anywhere: say why the registry refuses the ref, when it does."""
        if expectation.state_id_stream is not None and expectation.request_id is not None \
                and expectation.state_id_stream != stream_id(expectation.key, expectation.request_id):
            self.stack.count_rejection(MisroutedState())
            raise MisroutedState(f"state_id {state_id.hex()} was issued for another stream")
        if expectation.newest_version is not None and expectation.version is not None \
                and expectation.newest_version > expectation.version:
            self.stack.count_rejection(StaleState())
            raise StaleState(f"version {expectation.version} was superseded by {expectation.newest_version}")

    async def _check_specs(self, result: LoadResult, wanted: Wanted) -> LoadResult:
        specs = wanted.expectation.tensors
        found = tuple(t.spec for t in chosen(result.header.tensors, wanted.layers))
        if specs is None or found == tuple(specs):
            return result
        await self.leases.release(result.lease_id, wanted.owner)
        raise DestinationMismatch(f"the object holds tensors {[(s.name, s.dtype, s.shape) for s in found]}; the "
                                  f"destination expects {[(s.name, s.dtype, s.shape) for s in specs]}")

    def _count_refusal(self, exc: RejectedState, counted: bool) -> None:
        if counted:
            self.stack.count_rejection(exc)
        else:
            self.stack.count_skip(skip_reason(exc))


def _no_shared_tier_hint(stack) -> str:
    """What a miss means on a daemon without a cross-node tier: only its own puts are found."""
    if stack.publish is not None:
        return ""
    return (" of this daemon, and it has no Redis tier (redis.url unset): only objects put through this daemon "
            "are found here; a ref from another node needs both daemons on one Redis")
