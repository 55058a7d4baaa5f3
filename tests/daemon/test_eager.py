"""Requests run at once in the callback that received them (``daemon/server/eager.py``).

A coroutine's first step runs inside ``start_eagerly``, already inside the task that will
carry it (``current_task()`` is that task, so ``asyncio.timeout`` works from its first
line); one that never waits has ended when ``start_eagerly`` returns (its answer written
before the callback returns, nothing left to track); one that waits is carried on by that
task with what it waited for (a result, an error), and cancelling the task, before or after
its first turn, cancels what it waits for and unwinds the coroutine (its ``finally`` runs);
each runs in a context of its own. Through a real server: a request answered from memory
has ended in the callback that read it.
"""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from statetier.daemon.server.eager import start_eagerly
from statetier.protocol.frames import Op
from tests.support.server_harness import running_daemon

MARK = contextvars.ContextVar("mark", default="unset")


async def test_a_coroutine_that_never_waits_ends_without_a_task():
    done = []

    async def answer():
        MARK.set("mine")
        done.append(MARK.get())

    assert start_eagerly(asyncio.get_running_loop(), answer()) is None
    assert done == ["mine"] and MARK.get() == "unset"  # its context was its own


async def test_a_coroutine_that_waits_is_carried_on_with_results_and_errors():
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()
    seen = []

    async def answer():
        MARK.set("task")
        seen.append(await first)
        try:
            await second
        except KeyError as exc:
            seen.append(repr(exc))
        await asyncio.sleep(0)  # a bare yield too
        seen.append(MARK.get())
        return "answered"

    task = start_eagerly(loop, answer())
    assert isinstance(task, asyncio.Task) and seen == []
    first.set_result(7)
    await asyncio.sleep(0)
    second.set_exception(KeyError("k"))
    assert await task == "answered"
    assert seen == [7, "KeyError('k')", "task"] and MARK.get() == "unset"


@pytest.mark.parametrize("turns_first", [1, 0], ids=["after_its_first_turn", "before_its_first_turn"])
async def test_cancelling_the_task_cancels_what_it_waits_for_and_unwinds_the_coroutine(turns_first):
    loop = asyncio.get_running_loop()
    waited = loop.create_future()
    unwound = []

    async def answer():
        try:
            await waited
        finally:
            unwound.append(True)

    task = start_eagerly(loop, answer())
    for _ in range(turns_first):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert waited.cancelled() and unwound == [True]


async def test_a_timeout_entered_before_the_first_wait_runs_inside_the_task():
    # regression: a Redis Cluster (re)connect enters asyncio.timeout before it first waits;
    # run outside any task it raised "Timeout should be used inside a task" (chaos, faults)
    loop = asyncio.get_running_loop()
    never = loop.create_future()
    seen = []

    async def answer():
        seen.append(asyncio.current_task())
        try:
            async with asyncio.timeout(0.01):
                await never
        except TimeoutError:
            seen.append("timed out")
        return "answered"

    task = start_eagerly(loop, answer())
    assert seen == [task]
    assert await task == "answered"
    assert seen == [task, "timed out"] and never.cancelled()


async def test_a_coroutine_started_inside_another_task_leaves_that_task_current():
    outer = asyncio.current_task()
    inner = []

    async def answer():
        inner.append(asyncio.current_task())

    assert start_eagerly(asyncio.get_running_loop(), answer()) is None
    assert asyncio.current_task() is outer and inner and inner[0] is not outer


async def test_an_error_in_the_first_step_reaches_the_caller_and_the_task_ends_quietly():
    async def answer():
        raise KeyError("at once")

    with pytest.raises(KeyError):
        start_eagerly(asyncio.get_running_loop(), answer())


async def test_a_request_answered_from_memory_runs_in_the_callback_with_no_task(monkeypatch):
    created = []
    async with running_daemon() as daemon:
        loop = asyncio.get_running_loop()
        original = loop.create_task

        def counting(coro, **kwargs):
            task = original(coro, **kwargs)
            created.append(task)
            return task

        client = await daemon.unix_client()
        assert (await client.hello()).op is Op.HELLO_OK
        monkeypatch.setattr(loop, "create_task", counting)
        stats = await client.request(Op.STATS)
        assert stats.op is Op.REPLY and stats.meta["daemon"]["inflight_requests"] == 1  # itself, running
        assert len(created) == 1 and created[0].get_coro().ended  # answered in the callback that read it
        again = await client.request(Op.STATS)  # the first left nothing to track
        assert again.meta["daemon"]["inflight_requests"] == 1
