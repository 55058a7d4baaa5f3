"""``protocol.thresholds``: the one rule for where copies and digests run (counted, not timed).

A job runs on the event loop when it digests fewer than ``INLINE_WORK_BYTES`` (plain copies
count for nothing: they hold the GIL wherever they run), or when there is no executor; else
it is one executor job. A caller cancelled while its job runs is cancelled once the job ended.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from statetier.protocol.thresholds import INLINE_WORK_BYTES, run_work, runs_inline


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(1)
        self.jobs = 0

    def submit(self, *args, **kwargs):
        self.jobs += 1
        return super().submit(*args, **kwargs)


@pytest.fixture
def executor():
    pool = CountingExecutor()
    yield pool
    pool.shutdown()


async def test_work_below_the_threshold_and_plain_copies_run_on_the_loop(executor):
    loop_thread = threading.get_ident()
    for hashed in (0, 1, INLINE_WORK_BYTES - 1):
        assert runs_inline(executor, hashed)
        assert await run_work(executor, hashed, threading.get_ident) == loop_thread
    assert executor.jobs == 0


async def test_work_at_the_threshold_is_one_executor_job(executor):
    assert not runs_inline(executor, INLINE_WORK_BYTES)
    ran_on = await run_work(executor, INLINE_WORK_BYTES, threading.get_ident)
    assert ran_on != threading.get_ident() and executor.jobs == 1


async def test_without_an_executor_everything_runs_on_the_loop():
    assert runs_inline(None, 1 << 30)
    assert await run_work(None, 1 << 30, threading.get_ident) == threading.get_ident()


async def test_a_cancelled_caller_waits_for_its_job_to_end(executor):
    started, release, ended = threading.Event(), threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        release.wait(5)
        ended.set()

    task = asyncio.ensure_future(run_work(executor, INLINE_WORK_BYTES, job))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()  # the job still runs: the caller must not unwind yet
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended.is_set()
