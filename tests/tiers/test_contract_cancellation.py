"""The tier contract under cancellation, run against every tier (as ``test_contract.py``).

A ``Caller`` runs a store's or a load's tier calls in order, as a real caller would; each
story cancels it before and inside every await of those calls in turn, and checks after
each landing that no object, lease, store in flight or reserved byte is left behind (an
object whose store completed before the cancel landed stays, whole). Fixtures are in
``tests/support/tier_contract.py``; a tier that takes no bytes (the peer tier) tells the load
story only, its object held by its owner and the cancels landing inside a real pull.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from statetier.tiers.peer import PeerTier
from statetier.tiers.redis import RedisTier
from tests.support.tier_contract import (  # noqa: F401  (fixtures are used by name)
    assert_full_capacity_fits,
    assert_invisible,
    assert_quiet,
    chunks_of,
    executor,
    load,
    make_object,
    needs_bytes,
    remove,
    settle,
    store,
    tier,
)

pytestmark = pytest.mark.timeout(60)


class Caller:
    """Runs tier calls in order, as a real caller would, saying where it is.

    ``park_at`` makes it wait forever just before that step (a cancellation "before" it);
    ``inside`` names the step whose tier call is running, so a test can cancel in it.
    """

    def __init__(self, park_at: str | None = None) -> None:
        self.park_at = park_at
        self.parked: str | None = None
        self.inside: str | None = None

    async def step(self, name: str, call, *args, **kwargs):
        if name == self.park_at:
            self.parked = name
            await asyncio.Event().wait()
        self.inside = name
        try:
            return await call(*args, **kwargs)
        finally:
            self.inside = None


async def store_as_caller(tier, meta, blob, caller: Caller) -> None:
    ticket, stored = None, False
    try:
        ticket = await caller.step("prepare_store", tier.prepare_store, meta)
        await caller.step("write", tier.write, ticket, chunks_of(meta, blob))
        await caller.step("complete_store", tier.complete_store, ticket, success=True)
        stored = True
    finally:
        if ticket is not None and not stored:
            await tier.complete_store(ticket, success=False)


async def load_as_caller(tier, object_id, caller: Caller) -> None:
    lease = None
    try:
        lease = await caller.step("prepare_load", tier.prepare_load, object_id, owner="caller")
        data = await caller.step("read", tier.read, lease)
        assert data.nbytes > 0
        await caller.step("complete_load", tier.complete_load, lease)
    finally:
        if lease is not None:
            await tier.complete_load(lease)  # idempotent: also after a completed one


#: Event-loop turns to let pass inside a step before cancelling, growing until the step ends first.
_TURNS = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 4096]


async def cancel_parked(run, step: str) -> None:
    caller = Caller(park_at=step)
    task = asyncio.create_task(run(caller))
    while caller.parked != step:
        assert not task.done(), f"the caller finished without reaching {step}"
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def may_lose_cancellations(tier) -> bool:
    """redis-py awaits ``asyncio.wait_for(writer.drain())`` while sending; before Python 3.12
    that swallows a cancellation landing as the drain finishes (CPython gh-86296), and the
    call simply completes. The caller then goes on as if never cancelled. The tiers that
    call redis-py on a load: Redis, and the peer tier (its directory)."""
    return isinstance(tier, (RedisTier, PeerTier)) and sys.version_info < (3, 12)


async def cancel_inside(run, step: str, turns: int, *, may_lose: bool) -> str | None:
    """Cancel ``turns`` loop turns into ``step``: "cancelled", "lost" (see above), or None when
    the step ended (or never suspended) first."""
    caller = Caller()
    task = asyncio.create_task(run(caller))
    seen = 0
    while not task.done():
        await asyncio.sleep(0)
        if caller.inside == step:
            if seen == turns:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    return "cancelled"
                assert may_lose, f"the cancellation inside {step} was swallowed"
                return "lost"
            seen += 1
    await task
    return None


async def cancellations(tier, run, steps, after_each) -> list[str]:
    """Cancel ``run`` before each step and at growing depths inside it; check after each."""
    landed = []
    for step in steps:
        await cancel_parked(run, step)
        await after_each()
        landed.append(f"before {step}")
        for turns in _TURNS:
            outcome = await cancel_inside(run, step, turns, may_lose=may_lose_cancellations(tier))
            await after_each()
            if outcome is None:  # it ran to the end: that too was checked and cleaned up
                break
            landed.append(f"{step}+{turns} {outcome}")
    return landed


async def test_a_cancelled_store_leaves_no_trace_at_any_await(tier, executor):
    needs_bytes(tier, "it takes no store of bytes to cancel (its owner's tiers do)")
    meta, blob = make_object()

    async def after_each():
        await settle(executor)  # a copy the cancelled write started has ended
        if await tier.contains(meta.object_id):  # the cancel came after the store had completed
            assert await load(tier, meta.object_id) == blob
            assert await tier.delete(meta.object_id)
        await assert_invisible(tier, meta)
        await assert_quiet(tier, 0, 0)
        await assert_full_capacity_fits(tier)

    landed = await cancellations(tier, lambda caller: store_as_caller(tier, meta, blob, caller),
                                 ("prepare_store", "write", "complete_store"), after_each)

    assert {"before prepare_store", "before write", "before complete_store"} <= set(landed)
    await store(tier, meta, blob)  # the object id is free for a store that runs to the end
    assert await load(tier, meta.object_id) == blob


async def test_a_cancelled_load_leaves_no_lease_at_any_await(tier, executor):
    meta, blob = make_object()
    await store(tier, meta, blob)

    async def after_each():
        await settle(executor)
        assert await tier.get_meta(meta.object_id) == meta
        await assert_quiet(tier, 1, meta.size)
        assert await load(tier, meta.object_id) == blob

    landed = await cancellations(tier, lambda caller: load_as_caller(tier, meta.object_id, caller),
                                 ("prepare_load", "read", "complete_load"), after_each)

    assert {"before prepare_load", "before read", "before complete_load"} <= set(landed)
    assert await remove(tier, meta.object_id)
    await assert_quiet(tier, 0, 0)
    await assert_full_capacity_fits(tier)
