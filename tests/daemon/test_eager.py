"""Requests run at once in the callback that received them (``daemon/server/eager.py``).

A coroutine that never waits ends inside ``start_eagerly`` (no task: its answer is written
before the callback returns); one that waits becomes a task that resumes it with what it
waited for (a result, an error), and cancelling that task cancels what it waits for and
unwinds the coroutine (its ``finally`` runs); each runs in a context of its own. Through a
real server: a PING-free request answered from memory creates no task at all.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from pathlib import Path

import pytest

from statetier.daemon.server.eager import start_eagerly
from statetier.protocol.frames import Op

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling server_harness.py
from server_harness import running_daemon  # noqa: E402

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


async def test_cancelling_the_task_cancels_what_it_waits_for_and_unwinds_the_coroutine():
    loop = asyncio.get_running_loop()
    waited = loop.create_future()
    unwound = []

    async def answer():
        try:
            await waited
        finally:
            unwound.append(True)

    task = start_eagerly(loop, answer())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert waited.cancelled() and unwound == [True]


async def test_a_request_answered_from_memory_runs_in_the_callback_with_no_task(monkeypatch):
    created = []
    async with running_daemon() as daemon:
        loop = asyncio.get_running_loop()
        original = loop.create_task

        def counting(coro, **kwargs):
            created.append(getattr(coro, "__qualname__", repr(coro)))
            return original(coro, **kwargs)

        client = await daemon.unix_client()
        assert (await client.hello()).op is Op.HELLO_OK
        monkeypatch.setattr(loop, "create_task", counting)
        stats = await client.request(Op.STATS)
        assert stats.op is Op.REPLY and stats.meta["daemon"]["inflight_requests"] == 1  # itself, running
        assert created == []  # answered in the callback that read it
