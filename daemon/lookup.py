"""The joint hit (DESIGN §4): how many tokens of a prefix can be restored, all layers at once.

``joint_hit(engine, req, owner) -> LookupResult`` answers the largest boundary N of
``req.boundaries`` at which

- every attention layer has KV pages covering ``[0, N)`` — one page per span between
  consecutive boundaries (``kv_layout="blocks"``) or one page ``[0, N)`` (``"prefix"``), and
- every SSM layer has a snapshot with ``tokens_absorbed == N`` for the same prefix hash,

or 0. A model with SSM layers never gets a KV-only answer, because the SSM condition is
part of every boundary's test. The objects behind the answer are leased to ``owner``
(when ``req.lease``) so they cannot be evicted or compacted away before the caller loads
or releases them; a load then verifies each one fully.
"""

from __future__ import annotations

from statetier.protocol.errors import InvalidRequest, NotFound, StatetierError
from statetier.protocol.identity import Kind, StateKey, StateRef
from statetier.tiers.base import ObjectMeta, Tier

from .requests import LookupRequest, LookupResult


class _Finder:
    """``engine.locate`` with a per-lookup cache (block pages are asked for repeatedly)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._cache: dict[StateKey, tuple[ObjectMeta, Tier] | None] = {}

    async def first(self, key: StateKey) -> tuple[ObjectMeta, Tier] | None:
        if key not in self._cache:
            found = await self.engine.locate(key)
            self._cache[key] = found[0] if found else None
        return self._cache[key]


def _checked(boundaries) -> list[tuple[int, bytes]]:
    out, previous = [], 0
    for end, prefix in boundaries:
        if not isinstance(end, int) or end <= previous or len(prefix) != 32:
            raise InvalidRequest("boundaries must be ascending (token_end, 32-byte prefix hash) pairs")
        out.append((end, bytes(prefix)))
        previous = end
    return out


def _needed_keys(req: LookupRequest, bounds: list[tuple[int, bytes]], i: int) -> list[StateKey]:
    end, prefix = bounds[i]
    keys = [StateKey(req.namespace, Kind.SSM, layer, prefix, 0, end, req.shard) for layer in req.ssm_layers]
    for layer in req.attention_layers:
        if req.kv_layout == "prefix":
            keys.append(StateKey(req.namespace, Kind.KV, layer, prefix, 0, end, req.shard))
            continue
        start = 0
        for block_end, block_prefix in bounds[: i + 1]:
            keys.append(StateKey(req.namespace, Kind.KV, layer, block_prefix, start, block_end, req.shard))
            start = block_end
    return keys


async def joint_hit(engine, req: LookupRequest, owner) -> LookupResult:
    if req.kv_layout not in ("blocks", "prefix"):
        raise InvalidRequest("kv_layout must be 'blocks' or 'prefix'")
    bounds = _checked(req.boundaries)
    if not bounds or not (req.attention_layers or req.ssm_layers):
        return LookupResult(0)
    finder = _Finder(engine)
    for i in reversed(range(len(bounds))):
        picks = []
        for key in _needed_keys(req, bounds, i):  # SSM keys first: they fail fastest
            found = await finder.first(key)
            if found is None:
                break
            picks.append((key, *found))
        else:
            result = await _lease_all(engine, req, owner, bounds[i][0], picks)
            if result is not None:
                return result
    return LookupResult(0)


async def _lease_all(engine, req: LookupRequest, owner, tokens: int, picks) -> LookupResult | None:
    """Lease every object of the answer, or none (an object vanished: try a lower boundary)."""
    result = LookupResult(tokens)
    taken: list[int] = []
    for key, meta, tier in picks:
        ref = StateRef(key, meta.request_id, meta.step, meta.object_id, meta.version)
        lease_id = None
        if req.lease:
            try:
                lease = await tier.prepare_load(meta.object_id, owner=owner, ttl=engine.options.lease_ttl)
            except (NotFound, StatetierError):
                for taken_id in taken:
                    await engine.release(taken_id, owner)
                return None
            lease_id = engine.hold_for_lookup(tier, lease, owner)
            taken.append(lease_id)
        result.objects.append((ref, lease_id))
    return result
