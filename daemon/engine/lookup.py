"""The joint hit (DESIGN §4): how many tokens of a prefix can be restored, all layers at once.

``joint_hit(stack, leases, req, owner) -> JointHit`` answers the largest boundary N of
``req.boundaries`` at which

- every attention layer has KV pages covering ``[0, N)`` — one page per span between
  consecutive boundaries (``kv_layout="blocks"``) or one page ``[0, N)`` (``"prefix"``), and
- every SSM layer has a snapshot with ``tokens_absorbed == N`` for the same prefix hash,
- every layer group (``req.groups``) has its group objects the same way: a KV group one per
  block (or ``[0, N)``), an SSM group one at N,

or 0 — on every TP shard of ``req.shards`` (a request is restorable at N only when every
shard of every layer is), or for a group with a ``req.group_shards`` count n on the first n
shards (1: a state every rank holds the same, stored once as shard 0). A model with SSM
layers never gets a KV-only answer, because the SSM condition is part of every boundary's
test. The objects behind the answer are leased
to ``owner`` (when ``req.lease``, held in ``leases``) so they cannot be evicted or compacted
away before the caller loads or releases them; a load then verifies each one fully.
An answer short of the largest boundary while moves are under way (a demotion holds an
object between two tiers) is looked for again once they settled, as a load that finds
nothing does. Keys are located by ``daemon.engine.candidates.locate_many`` (each key's newest servable
object), on the engine's ``Stack`` (tiers, registry, options, the skipped count).

Round trips: when a tier answers over the network (Redis), the keys of every boundary are
located at once (``Tier.find_by_keys``: on one Redis server two round trips in all, the
stream heads riding along), and a Redis lease reuses the manifest that lookup fetched, so
a whole request costs the same round trips whatever its layers, shards and boundaries.
Tiers that answer from memory are asked boundary by boundary, largest first: each
boundary's snapshots and pages in one batch.
"""

from __future__ import annotations


from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.groups import LayerGroup
from statetier.protocol.identity import Kind, StateKey, StateRef, fingerprint
from statetier.tiers.base import ObjectMeta, Tier

from .candidates import each, locate_many
from .leases import Leases
from ..requests import JointHit, LookupRequest
from .stack import Stack


class _Finder:
    """Each key's newest servable object (``locate_many``), with a per-lookup cache (block
    pages are asked for repeatedly)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self._cache: dict[StateKey, tuple[ObjectMeta, Tier] | None] = {}

    async def all_found(self, keys: list[StateKey]) -> list[tuple[ObjectMeta, Tier]] | None:
        """Every key's newest object, or None when one is missing. Keys are located
        concurrently: on a decode node each may cost Redis round trips."""
        missing = [key for key in dict.fromkeys(keys) if key not in self._cache]
        if missing:
            for key, candidates in zip(missing, await locate_many(self.stack, missing)):
                self._cache[key] = candidates[0] if candidates else None
        picks = [self._cache[key] for key in keys]
        found = [pick for pick in picks if pick is not None]
        return found if len(found) == len(picks) else None

    async def prefetch(self, keys: list[StateKey]) -> None:
        """Locate all these keys now, in one batch (later ``all_found`` calls hit the cache)."""
        await self.all_found(keys)


def _checked(boundaries) -> list[tuple[int, bytes]]:
    out, previous = [], 0
    for end, prefix in boundaries:
        if not isinstance(end, int) or end <= previous or len(prefix) != 32:
            raise InvalidRequest("boundaries must be ascending (token_end, 32-byte prefix hash) pairs")
        out.append((end, bytes(prefix)))
        previous = end
    return out


class _Needed:
    """(SSM snapshot keys, KV page keys) that must all exist at each boundary, built once
    each: a block page is one ``StateKey`` however many boundaries need it."""

    def __init__(self, req: LookupRequest, bounds: list[tuple[int, bytes]]) -> None:
        self.req, self.bounds = req, bounds
        self._shards = _group_shards(req)
        self._at: dict[int, tuple[list, list]] = {}
        self._pages: dict[int, list[StateKey]] = {}  # block j → its page of every (layer, shard)

    def at(self, i: int) -> tuple[list, list]:
        if i not in self._at:
            self._at[i] = self._build(i)
        return self._at[i]

    def everything(self) -> list[StateKey]:
        """Every key of every boundary, each once."""
        keys = {}
        for i in range(len(self.bounds)):
            ssm, kv = self.at(i)
            keys.update(dict.fromkeys(ssm))
            keys.update(dict.fromkeys(kv))
        return list(keys)

    def _build(self, i: int) -> tuple[list, list]:
        req, (end, prefix) = self.req, self.bounds[i]
        ssm = [key for placement in self._placements(Kind.SSM)
               for key in _keys(req.namespace, Kind.SSM, placement, prefix, 0, end, self.shards(placement))]
        if req.kv_layout == "prefix":
            kv = [key for placement in self._placements(Kind.KV)
                  for key in _keys(req.namespace, Kind.KV, placement, prefix, 0, end, self.shards(placement))]
            return ssm, kv
        pages = [self._page(j) for j in range(i + 1)]
        return ssm, [page[k] for k in range(len(pages[0])) for page in pages]  # by layer, shard, block

    def shards(self, placement: int | LayerGroup) -> tuple[int, ...]:
        """The shards holding a layer's (every shard) or a group's objects."""
        return self._shards.get(placement, self.req.shards) if isinstance(placement, LayerGroup) else self.req.shards

    def _placements(self, kind: Kind) -> list:
        """The layers (per-layer objects) and groups (group objects) of ``kind`` asked for."""
        layers = self.req.ssm_layers if kind is Kind.SSM else self.req.attention_layers
        return [*layers, *(group for group in self.req.groups if group.kind is kind)]

    def _page(self, j: int) -> list[StateKey]:
        if j not in self._pages:
            req, (end, prefix) = self.req, self.bounds[j]
            start = self.bounds[j - 1][0] if j else 0
            self._pages[j] = [key for placement in self._placements(Kind.KV)
                              for key in _keys(req.namespace, Kind.KV, placement, prefix, start, end,
                                               self.shards(placement))]
        return self._pages[j]


def _group_shards(req: LookupRequest) -> dict[LayerGroup, tuple[int, ...]]:
    """The shards of each group given a ``group_shards`` count: the first n of ``req.shards``."""
    if not req.group_shards:
        return {}
    if len(req.group_shards) != len(req.groups):
        raise InvalidRequest(f"group_shards names {len(req.group_shards)} shard counts for {len(req.groups)} groups")
    for count in req.group_shards:
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= len(req.shards):
            raise InvalidRequest(f"a group's shard count must be 1 … {len(req.shards)} (the TP size), not {count!r}")
    return {group: req.shards[:count] for group, count in zip(req.groups, req.group_shards)}


def _keys(namespace, kind: Kind, placement: int | LayerGroup, prefix: bytes, start: int, end: int,
          shards) -> list[StateKey]:
    """The key of one layer's object, or of one group's group object, on every shard (the
    request's values were checked when it was decoded and by ``_checked``)."""
    if isinstance(placement, LayerGroup):
        return [StateKey.from_checked(namespace, kind, placement.group_id, prefix, start, end, shard, placement.layers)
                for shard in shards]
    return [StateKey.from_checked(namespace, kind, placement, prefix, start, end, shard) for shard in shards]


async def joint_hit(stack: Stack, leases: Leases, req: LookupRequest, owner) -> JointHit:
    if req.kv_layout not in ("blocks", "prefix"):
        raise InvalidRequest("kv_layout must be 'blocks' or 'prefix'")
    bounds = _checked(req.boundaries)
    _group_shards(req)  # a bad shard count is refused whatever else the request asks
    if not bounds or not (req.attention_layers or req.ssm_layers or req.groups):
        return JointHit(0)
    hit = await _best_hit(stack, leases, req, owner, bounds)
    if hit.tokens < max(tokens for tokens, _ in bounds) and stack.placement.has_moves:
        # as a load that finds nothing: an object may be between two tiers (a demotion)
        for _, lease_id in hit.objects:
            if lease_id is not None:
                await leases.release(lease_id, owner)
        await stack.placement.settle_moves()
        hit = await _best_hit(stack, leases, req, owner, bounds)
    return hit


async def _best_hit(stack: Stack, leases: Leases, req: LookupRequest, owner, bounds: list[tuple[int, bytes]]
                    ) -> JointHit:
    """The largest boundary at which every object is found (and leased, when asked)."""
    finder, needed = _Finder(stack), _Needed(req, bounds)
    if not all(tier.answers_in_memory for tier in stack.tiers):  # a batch costs what one key does
        await finder.prefetch(needed.everything())
    for i in reversed(range(len(bounds))):
        ssm_keys, kv_keys = needed.at(i)
        keys = ssm_keys + kv_keys
        # one locate for the boundary's snapshots and pages (a block's page, located once, is
        # known to every lower boundary that needs it)
        found = await finder.all_found(keys)
        if found is None:
            continue
        picks = [(key, *pick) for key, pick in zip(keys, found)]
        result = await _lease_all(stack, leases, req, owner, bounds[i][0], picks)
        if result is not None:
            return result
    return JointHit(0)


async def _leases(stack: Stack, owner, picks) -> list:
    """``prepare_load`` of every pick, in order (failures returned): those a tier answers
    from memory one by one, the others concurrently."""
    leases: list = [None] * len(picks)
    remote = []
    for n, (_, meta, tier) in enumerate(picks):
        call = tier.prepare_load(meta.object_id, owner=owner, ttl=stack.options.lease_ttl)
        if not tier.leases_in_memory(meta.object_id):
            remote.append((n, call))
            continue
        try:
            leases[n] = await call
        except Exception as exc:  # noqa: BLE001 - returned like gather(return_exceptions=True)
            leases[n] = exc
    for (n, _), lease in zip(remote, await each(False, [call for _, call in remote]) if remote else []):
        leases[n] = lease
    return leases


async def _lease_all(stack: Stack, held_for: Leases, req: LookupRequest, owner, tokens: int, picks
                     ) -> JointHit | None:
    """Lease every object of the answer, or none (an object vanished: try a lower boundary)."""
    refs = [StateRef.from_checked(key, meta.request_id, meta.step, meta.object_id, meta.version,
                                  fingerprint(key, meta.request_id, meta.step)) for key, meta, _ in picks]
    if not req.lease:
        return JointHit(tokens, [(ref, None) for ref in refs])
    leases = await _leases(stack, owner, picks)
    if any(isinstance(lease, BaseException) for lease in leases):
        for (_, _, tier), lease in zip(picks, leases):
            if not isinstance(lease, BaseException):
                await tier.complete_load(lease)
        failure = next(lease for lease in leases if isinstance(lease, BaseException))
        if not isinstance(failure, StatetierError):
            raise failure
        return None
    held = [held_for.hold(tier, lease, owner)[0] for (_, _, tier), lease in zip(picks, leases)]
    return JointHit(tokens, list(zip(refs, held)))

