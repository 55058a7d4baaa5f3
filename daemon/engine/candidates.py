"""Candidates: the stored objects under a key that may be served (DESIGN §4), newest first.

- ``locate(stack, key, allow_speculative=False)`` → ``[(ObjectMeta, Tier)]``: every servable
  object under ``key`` (the fastest tier holding each), newest first (``Engine.locate``; a
  load by key tries them in that order, ``daemon.engine.loads``)
- ``servable(found, allow_speculative, count_skip)`` → the ``(meta, tier)`` of each
  ``(meta, tier, stream head)`` that may be served: ``locate``'s judgement, shared with
  ``daemon.engine.lookup.locate_newest`` (many keys at once, for the joint hit)

Servable: not superseded in the version registry (skipped as ``stale``) and not a
speculative snapshot unless allowed (``speculative``); each skip is counted
(``count_skip``). Tiers that are ``Unavailable`` are passed over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from statetier.protocol.errors import Unavailable
from statetier.protocol.identity import StateKey
from statetier.tiers.base import ObjectMeta, Tier

from .stack import Stack


def newest_first(item: tuple[ObjectMeta, Tier]):
    """The sort key of a candidate: its version, then when it was made."""
    return item[0].version, item[0].created_at_ns


def servable(found: Iterable, allow_speculative: bool, count_skip) -> list[tuple[ObjectMeta, Tier]]:
    """The (meta, tier) of each (meta, tier, stream head) that may be served; the others
    counted by reason with ``count_skip``."""
    out = []
    for meta, tier, head in found:
        if head is not None and head.version > meta.version:
            count_skip("stale")
        elif meta.speculative and not allow_speculative:
            count_skip("speculative")
        else:
            out.append((meta, tier))
    return out


async def locate(stack: Stack, key: StateKey, *, allow_speculative: bool = False) -> list[tuple[ObjectMeta, Tier]]:
    """Tiers and the registry are asked concurrently."""
    digest = key.digest()
    answers = await asyncio.gather(*(tier.find_by_key(digest) for tier in stack.tiers), return_exceptions=True)
    seen: dict[bytes, tuple[ObjectMeta, Tier]] = {}
    for tier, metas in zip(stack.tiers, answers):
        if isinstance(metas, Unavailable):
            continue
        if isinstance(metas, BaseException):
            raise metas
        for meta in metas:
            seen.setdefault(meta.object_id, (meta, tier))
    heads = await asyncio.gather(*(stack.registry.newest(meta.stream_id) for meta, _ in seen.values()))
    found = ((meta, tier, head) for (meta, tier), head in zip(seen.values(), heads))
    return sorted(servable(found, allow_speculative, stack.count_skip), key=newest_first, reverse=True)
