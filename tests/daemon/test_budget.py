"""ByteBudget: bounded FIFO waits, Busy past the wait, nothing left behind by cancellation."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest

from statetier.daemon.server.budget import ByteBudget
from statetier.daemon.metrics import Metrics
from statetier.protocol.errors import Busy, InvalidRequest

LONG = 60.0  # a wait that never runs out within a test


def busy_count(metrics: Metrics) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("statetier_busy_total "):
            return float(line.split()[1])
    return 0.0


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_hold_takes_and_gives_back_bytes() -> None:
    budget = ByteBudget(100, LONG)
    async with budget.hold(60):
        assert budget.in_use == 60
        async with budget.hold(40):
            assert budget.in_use == 100
    assert budget.in_use == 0


async def test_waiters_are_served_in_arrival_order_without_barging() -> None:
    budget = ByteBudget(100, LONG)
    await budget.acquire(80)
    granted: list[str] = []

    async def take(name: str, nbytes: int) -> None:
        await budget.acquire(nbytes)
        granted.append(name)

    big = asyncio.create_task(take("big", 50))
    await settle()
    small = asyncio.create_task(take("small", 10))  # would fit now, but queues behind "big"
    await settle()
    assert granted == [] and budget.waiting == 2 and budget.in_use == 80

    budget.release(80)
    await asyncio.gather(big, small)
    assert granted == ["big", "small"]
    assert budget.in_use == 60 and budget.waiting == 0


async def test_busy_after_the_bounded_wait_is_counted_and_leaves_no_waiter() -> None:
    metrics = Metrics()
    budget = ByteBudget(100, 0.05, metrics)
    await budget.acquire(100)
    with pytest.raises(Busy, match="byte budget exhausted"):
        await budget.acquire(1)
    assert busy_count(metrics) == 1
    assert budget.waiting == 0 and budget.in_use == 100
    budget.release(100)
    async with budget.hold(100):
        assert budget.in_use == 100


async def test_zero_wait_is_busy_at_once() -> None:
    budget = ByteBudget(10, 0)
    await budget.acquire(10)
    with pytest.raises(Busy):
        await budget.acquire(1)
    assert budget.waiting == 0


async def test_a_request_larger_than_the_whole_budget_is_invalid_at_once() -> None:
    budget = ByteBudget(100, LONG)
    with pytest.raises(InvalidRequest, match="exceed the daemon's whole byte budget of 100"):
        await budget.acquire(101)
    assert budget.in_use == 0 and budget.waiting == 0


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    budget = ByteBudget(100, LONG)
    await budget.acquire(100)
    waiter = asyncio.create_task(budget.acquire(30))
    await settle()
    assert budget.waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.waiting == 0 and budget.in_use == 100
    budget.release(100)
    assert budget.in_use == 0


async def test_a_cancelled_head_unblocks_the_waiter_behind_it() -> None:
    budget = ByteBudget(100, LONG)
    await budget.acquire(60)
    head = asyncio.create_task(budget.acquire(50))
    await settle()
    behind = asyncio.create_task(budget.acquire(30))
    await settle()
    assert not behind.done()
    head.cancel()
    await behind
    assert budget.in_use == 90 and budget.waiting == 0
    with pytest.raises(asyncio.CancelledError):
        await head


async def test_bytes_granted_to_a_waiter_cancelled_at_that_moment_go_back() -> None:
    budget = ByteBudget(100, LONG)
    await budget.acquire(100)
    waiter = asyncio.create_task(budget.acquire(40))
    await settle()
    budget.release(100)  # grants the waiter's 40 bytes before its task runs again
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert budget.in_use == 0 and budget.waiting == 0


async def test_an_expired_head_unblocks_the_waiter_behind_it() -> None:
    budget = ByteBudget(100, 0.05)
    await budget.acquire(60)
    head = asyncio.create_task(budget.acquire(50))
    await settle()
    behind = asyncio.create_task(budget.acquire(30))  # fits, but waits behind the head
    with pytest.raises(Busy):
        await head
    await behind  # granted the moment the head gave up, before its own wait ran out
    assert budget.in_use == 90 and budget.waiting == 0


async def test_release_of_more_than_held_is_a_programming_error() -> None:
    budget = ByteBudget(100, LONG)
    await budget.acquire(10)
    with pytest.raises(RuntimeError):
        budget.release(11)
