"""Removing copies: a client's delete, and a damaged copy dropped where it was found.

- ``delete(stack, tenant, ref)`` → copies removed (``Engine.delete``, the DELETE handler):
  every copy of ``ref``'s object is gone once it returns. The tiers are swept under a
  tombstone (``Placement.deleting``: no move starts a copy meanwhile), every move begun
  before is waited for (an eviction may hold the object between two tiers), and the tiers
  are swept again for what such a move left behind. ``Forbidden`` when a tier holds that
  state_id under another key.
- ``drop_copy(stack, tier, state_id)`` — one damaged copy, its tenant bytes refunded
  (``daemon.engine.serving`` on damage, ``daemon.engine.audit`` on ``statetier verify``); a tier
  that cannot delete it is logged, not raised.
"""

from __future__ import annotations

import logging

from statetier.protocol.errors import Forbidden, StatetierError, Unavailable
from statetier.protocol.identity import StateRef
from statetier.tiers.base import Tier

from .stack import Stack

log = logging.getLogger("statetier.engine")


async def delete(stack: Stack, tenant: str, ref: StateRef) -> int:
    stack.tenancy.check_namespace(tenant, ref.key.namespace)
    async with stack.placement.deleting(ref.state_id):
        deleted = await _sweep(stack, ref)
        await stack.placement.settle_moves()
        deleted += await _sweep(stack, ref)
    return deleted


async def _sweep(stack: Stack, ref: StateRef) -> int:
    deleted = 0
    for tier in stack.tiers:
        try:
            meta = await tier.get_meta(ref.state_id)
            if meta is not None and meta.key_digest != ref.key.digest():
                raise Forbidden("that state_id does not belong to the given key")
            if await tier.delete(ref.state_id):
                deleted += 1
            stack.tenancy.refund(tier.name, ref.state_id)
        except Unavailable:
            continue
    return deleted


async def drop_copy(stack: Stack, tier: Tier, state_id: bytes) -> None:
    try:
        await tier.delete(state_id)
    except StatetierError as exc:
        log.warning("could not drop damaged copy %s from %s: %s", state_id.hex(), tier.name, exc)
    stack.tenancy.refund(tier.name, state_id)
