"""Run a request's coroutine at once, in the callback that received it; a task only if it waits.

``start_eagerly(loop, coro)`` → ``None`` when ``coro`` ran to its end without waiting (a
PING, a lookup or a load answered from memory: no task created, no loop turn between the
request and its reply), else an ``asyncio.Task`` that carries it on from where it waited:
it awaits what ``coro`` waits for, then resumes ``coro``, until it ends. Cancelling that
task cancels what ``coro`` waits for and throws ``CancelledError`` into ``coro``, as
cancelling a task that ran ``coro`` from the start would. Each coroutine runs in a context
of its own (a copy of the caller's, as a task's would be), so a context variable one
request sets (``daemon.trace``) is never seen by another.

What Python 3.12 calls an eager task; the daemon runs on 3.11.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any


def start_eagerly(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
    context = contextvars.copy_context()
    try:
        waiting = context.run(coro.send, None)
    except StopIteration:
        return None
    except BaseException:
        coro.close()
        raise
    return loop.create_task(_carry_on(coro, waiting), context=context)


def _taken(waiting: Any) -> Any:
    """What ``coro`` yielded, taken over as a task takes it: a future's "blocking" mark is
    cleared, so that awaiting the same future again is allowed."""
    if waiting is not None and getattr(waiting, "_asyncio_future_blocking", None) is not None:
        waiting._asyncio_future_blocking = False
    return waiting


async def _carry_on(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    while True:
        try:
            if _taken(waiting) is None:
                await asyncio.sleep(0)  # a bare yield: give the loop one turn, as a task would
            else:
                await waiting
        except asyncio.CancelledError as cancelled:  # ours (``waiting`` is cancelled with us)
            try:
                waiting = coro.throw(cancelled)
            except StopIteration as done:
                return done.value
            continue
        except BaseException:
            pass  # what ``waiting`` raised: ``coro`` sees it when it resumes its own await
        try:
            waiting = coro.send(None)
        except StopIteration as done:
            return done.value
