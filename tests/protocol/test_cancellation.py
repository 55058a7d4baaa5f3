"""wait_out_cancellation: a cancelled caller still waits for work it cannot stop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from statetier.protocol.cancellation import wait_out_cancellation


async def test_a_cancelled_caller_returns_only_after_the_thread_finished_and_then_raises_cancelled():
    started, release = threading.Event(), threading.Event()
    finished: list[str] = []

    def job() -> str:
        started.set()
        release.wait(10)
        finished.append("done")
        return "result"

    with ThreadPoolExecutor(1) as executor:
        future = asyncio.get_running_loop().run_in_executor(executor, job)
        waiter = asyncio.create_task(wait_out_cancellation(future))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        waiter.cancel()
        await asyncio.sleep(0)
        waiter.cancel()  # a second cancellation is absorbed too
        for _ in range(3):
            await asyncio.sleep(0)
        assert not waiter.done() and finished == []
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert finished == ["done"] and future.result() == "result"


async def test_a_caller_not_cancelled_gets_the_result_or_the_error():
    loop = asyncio.get_running_loop()
    assert await wait_out_cancellation(loop.run_in_executor(None, lambda: 7)) == 7
    with pytest.raises(ZeroDivisionError):
        await wait_out_cancellation(loop.run_in_executor(None, lambda: 1 / 0))
