"""The joint hit (DESIGN §4): how many tokens of a prefix can be restored, all layers at once.

``joint_hit(engine, req, owner) -> LookupResult`` answers the largest boundary N of
``req.boundaries`` at which

- every attention layer has KV pages covering ``[0, N)`` — one page per span between
  consecutive boundaries (``kv_layout="blocks"``) or one page ``[0, N)`` (``"prefix"``), and
- every SSM layer has a snapshot with ``tokens_absorbed == N`` for the same prefix hash,

or 0 — on every TP shard of ``req.shards`` (a request is restorable at N only when every
shard of every layer is). A model with SSM layers never gets a KV-only answer, because the
SSM condition is part of every boundary's test. The objects behind the answer are leased
to ``owner`` (when ``req.lease``) so they cannot be evicted or compacted away before the
caller loads or releases them; a load then verifies each one fully.
"""

from __future__ import annotations

import asyncio

from statetier.protocol.errors import InvalidRequest, StatetierError, Unavailable
from statetier.protocol.identity import Kind, StateKey, StateRef
from statetier.tiers.base import ObjectMeta, Tier

from .requests import LookupRequest, LookupResult


class _Finder:
    """``engine.locate`` with a per-lookup cache (block pages are asked for repeatedly)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._cache: dict[StateKey, tuple[ObjectMeta, Tier] | None] = {}

    async def all_found(self, keys: list[StateKey]) -> list[tuple[ObjectMeta, Tier]] | None:
        """Every key's newest object, or None when one is missing. Keys are located
        concurrently: on a decode node each may cost Redis round trips."""
        missing = [key for key in dict.fromkeys(keys) if key not in self._cache]
        if missing:
            for key, pick in zip(missing, await locate_newest(self.engine, missing)):
                self._cache[key] = pick
        picks = [self._cache[key] for key in keys]
        return None if any(pick is None for pick in picks) else picks


async def _each(in_memory: bool, calls: list) -> list:
    """The awaitables' results in order: one by one when they answer from memory (a task
    each would cost more than the answer), else concurrently. Exceptions are returned."""
    if not in_memory:
        return await asyncio.gather(*calls, return_exceptions=True)
    out = []
    for call in calls:
        try:
            out.append(await call)
        except Exception as exc:  # noqa: BLE001 - returned like gather(return_exceptions=True)
            out.append(exc)
    return out


async def locate_newest(engine, keys: list[StateKey]) -> list[tuple[ObjectMeta, Tier] | None]:
    """For each key, what ``engine.locate(key)`` would answer first (the fastest tier's copy
    of the newest servable object: not superseded in the registry, not speculative; the
    skipped counted as ``locate`` counts them), or None — for many keys at once."""
    digests = [key.digest() for key in keys]
    seen: list[dict[bytes, tuple[ObjectMeta, Tier]]] = [{} for _ in keys]
    for tier in engine.tiers:
        answers = await _each(tier.answers_in_memory, [tier.find_by_key(digest) for digest in digests])
        for found, metas in zip(seen, answers):
            if isinstance(metas, Unavailable):
                continue
            if isinstance(metas, BaseException):
                raise metas
            for meta in metas:
                found.setdefault(meta.object_id, (meta, tier))
    streams = list({meta.stream_id for found in seen for meta, _ in found.values()})
    registry = engine.registry
    answers = await _each(registry.answers_in_memory, [registry.newest(stream) for stream in streams])
    for answer in answers:
        if isinstance(answer, BaseException):
            raise answer
    heads = dict(zip(streams, answers))
    picks = []
    for found in seen:
        servable = []
        for meta, tier in found.values():
            head = heads[meta.stream_id]
            if head is not None and head.version > meta.version:
                engine.count_skip("stale")
            elif meta.speculative:
                engine.count_skip("speculative")
            else:
                servable.append((meta, tier))
        picks.append(max(servable, key=lambda item: (item[0].version, item[0].created_at_ns)) if servable else None)
    return picks


def _checked(boundaries) -> list[tuple[int, bytes]]:
    out, previous = [], 0
    for end, prefix in boundaries:
        if not isinstance(end, int) or end <= previous or len(prefix) != 32:
            raise InvalidRequest("boundaries must be ascending (token_end, 32-byte prefix hash) pairs")
        out.append((end, bytes(prefix)))
        previous = end
    return out


def _needed_keys(req: LookupRequest, bounds: list[tuple[int, bytes]], i: int) -> tuple[list, list]:
    """(SSM snapshot keys, KV page keys) that must all exist for boundary ``i``."""
    end, prefix = bounds[i]
    ssm = [StateKey(req.namespace, Kind.SSM, layer, prefix, 0, end, shard)
           for layer in req.ssm_layers for shard in req.shards]
    kv = []
    for layer in req.attention_layers:
        for shard in req.shards:
            if req.kv_layout == "prefix":
                kv.append(StateKey(req.namespace, Kind.KV, layer, prefix, 0, end, shard))
                continue
            start = 0
            for block_end, block_prefix in bounds[: i + 1]:
                kv.append(StateKey(req.namespace, Kind.KV, layer, block_prefix, start, block_end, shard))
                start = block_end
    return ssm, kv


async def joint_hit(engine, req: LookupRequest, owner) -> LookupResult:
    if req.kv_layout not in ("blocks", "prefix"):
        raise InvalidRequest("kv_layout must be 'blocks' or 'prefix'")
    bounds = _checked(req.boundaries)
    if not bounds or not (req.attention_layers or req.ssm_layers):
        return LookupResult(0)
    finder = _Finder(engine)
    for i in reversed(range(len(bounds))):
        ssm_keys, kv_keys = _needed_keys(req, bounds, i)
        ssm = await finder.all_found(ssm_keys)  # snapshots first: they fail fastest
        kv = await finder.all_found(kv_keys) if ssm is not None else None
        if kv is None:
            continue
        picks = [(key, *found) for key, found in zip(ssm_keys + kv_keys, ssm + kv)]
        result = await _lease_all(engine, req, owner, bounds[i][0], picks)
        if result is not None:
            return result
    return LookupResult(0)


async def _lease_all(engine, req: LookupRequest, owner, tokens: int, picks) -> LookupResult | None:
    """Lease every object of the answer, or none (an object vanished: try a lower boundary)."""
    refs = [StateRef(key, meta.request_id, meta.step, meta.object_id, meta.version) for key, meta, _ in picks]
    if not req.lease:
        return LookupResult(tokens, [(ref, None) for ref in refs])
    calls = [tier.prepare_load(meta.object_id, owner=owner, ttl=engine.options.lease_ttl) for _, meta, tier in picks]
    leases = await _each(all(tier.answers_in_memory for _, _, tier in picks), calls)
    if any(isinstance(lease, BaseException) for lease in leases):
        for (_, _, tier), lease in zip(picks, leases):
            if not isinstance(lease, BaseException):
                await tier.complete_load(lease)
        failure = next(lease for lease in leases if isinstance(lease, BaseException))
        if not isinstance(failure, StatetierError):
            raise failure
        return None
    held = [engine.hold_for_lookup(tier, lease, owner) for (_, _, tier), lease in zip(picks, leases)]
    return LookupResult(tokens, list(zip(refs, held)))

