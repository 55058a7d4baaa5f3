"""Candidates: the stored objects under a key that may be served (DESIGN §4), newest first.

- ``locate_many(stack, keys, allow_speculative=False)`` → per key, ``[(ObjectMeta, Tier)]``:
  every servable object under it (the fastest tier holding each), newest first. Each tier
  is asked once for all the keys (``Tier.find_by_keys``: on Redis two round trips, the
  stream heads and the cluster's purge marks riding along), the registry once for the heads
  no tier brought. A purge mark new here (``stack.purges``) is honoured first, and the keys
  are located again: nothing another daemon's purge named is served.
- ``locate(stack, key, allow_speculative=False)`` — ``locate_many`` of one key
  (``Engine.locate``; a load by key tries them in that order, ``daemon.engine.loads``);
  ``daemon.engine.lookup`` takes the first of each key's for the joint hit.
- ``servable(found, allow_speculative, count_skip)`` → the ``(meta, tier)`` of each
  ``(meta, tier, stream head)`` that may be served.
- ``each(in_memory, calls)`` — awaitables' results in order, exceptions returned: one by one
  when they answer from memory, else concurrently.

Servable: not superseded in the version registry (skipped as ``stale``) and not a
speculative snapshot unless allowed (``speculative``); each skip is counted
(``count_skip``). Tiers that are ``Unavailable`` are passed over. Tiers that answer from
memory are asked one after the other (a task each would cost more than the answer), the
others concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from statetier.protocol.errors import Unavailable
from statetier.protocol.identity import StateKey
from statetier.tiers.base import KeyMatches, ObjectMeta, Tier

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


async def each(in_memory: bool, calls: list) -> list:
    """See the module docstring."""
    if not in_memory:
        return await asyncio.gather(*calls, return_exceptions=True)
    out = []
    for call in calls:
        try:
            out.append(await call)
        except Exception as exc:  # noqa: BLE001 - returned like gather(return_exceptions=True)
            out.append(exc)
    return out


async def locate(stack: Stack, key: StateKey, *, allow_speculative: bool = False) -> list[tuple[ObjectMeta, Tier]]:
    return (await locate_many(stack, [key], allow_speculative=allow_speculative))[0]


async def locate_many(stack: Stack, keys: list[StateKey], *, allow_speculative: bool = False
                      ) -> list[list[tuple[ObjectMeta, Tier]]]:
    """See the module docstring."""
    digests = [key.digest() for key in keys]
    seen: list[dict[bytes, tuple[ObjectMeta, Tier]]] = [{} for _ in keys]
    registry, tiers, heads = stack.registry, stack.tiers, {}
    answers = await each(all(tier.answers_in_memory for tier in tiers),
                         [tier.find_by_keys(digests, registry) for tier in tiers])
    marks = [matches.purge_marks for matches in answers
             if isinstance(matches, KeyMatches) and matches.purge_marks is not None]
    if marks and stack.purges is not None and await stack.purges.take(marks[0]):
        # another daemon's purge, new here: its copies are gone now; what was located may have been them
        return await locate_many(stack, keys, allow_speculative=allow_speculative)
    for tier, matches in zip(tiers, answers):
        if isinstance(matches, Unavailable):
            continue
        if isinstance(matches, BaseException):
            raise matches
        heads.update(matches.heads)
        for found, metas in zip(seen, matches.metas):
            for meta in metas:
                found.setdefault(meta.object_id, (meta, tier))
    streams = list({meta.stream_id for found in seen for meta, _ in found.values()} - heads.keys())
    if streams:  # the heads no tier brought along: one batch
        heads.update(zip(streams, await registry.newest_many(streams)))
    return [sorted(servable(((meta, tier, heads[meta.stream_id]) for meta, tier in found.values()),
                            allow_speculative, stack.count_skip), key=newest_first, reverse=True)
            for found in seen]
