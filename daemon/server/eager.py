"""Run a request's coroutine at once, in the callback that received it, inside its own task.

``start_eagerly(loop, coro)`` creates the task that will carry ``coro`` and runs ``coro``'s
first step at once, in the caller's callback, with that task as ``asyncio.current_task()``
(so ``asyncio.timeout`` and anything else that needs its task works from the first line):
a request answered from memory (a lookup, a load) writes its reply before the callback
returns, with no loop turn in between. It returns ``None`` when ``coro`` ended in that step
(the task then ends on its first turn, with nothing to track), else the task, which carries
``coro`` on from what it waits for, exactly as a task that ran it from the start would:
its cancellation reaches ``coro``, an ``asyncio.timeout`` entered in the first step
cancels that task. An error raised in the first step is raised to the caller. Each
coroutine runs in a context of its own (a copy of the caller's, as a task's would be), so a
context variable one request sets (``daemon.trace``) is never seen by another.

What Python 3.12 calls an eager task; the daemon runs on 3.11, whose tasks always wait
for a loop turn before their first step.
"""

from __future__ import annotations

import asyncio
import contextvars
from asyncio.tasks import _enter_task, _leave_task  # what 3.12's eager tasks use
from collections.abc import Coroutine
from typing import Any


def start_eagerly(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
    context = contextvars.copy_context()
    started = _Started(coro)
    task = loop.create_task(started, context=context)
    outer = asyncio.current_task(loop)
    if outer is not None:
        _leave_task(loop, outer)
    _enter_task(loop, task)
    try:
        context.run(started.first_step)
    finally:
        _leave_task(loop, task)
        if outer is not None:
            _enter_task(loop, outer)
    return None if started.ended else task


class _Started(Coroutine):
    """``coro`` with its first step already taken: the task's first ``send`` hands the task
    what that step yielded (a future whose "blocking" mark is still set, as the task
    expects), or ends; every later ``send``/``throw`` goes to ``coro`` itself."""

    __slots__ = ("_coro", "_yielded", "_handed", "ended")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self._yielded: Any = None
        self._handed = False
        self.ended = False

    def first_step(self) -> None:
        try:
            self._yielded = self._coro.send(None)
        except StopIteration:
            self.ended = True
        except BaseException:
            self.ended = True
            self._coro.close()
            raise

    def send(self, value: Any) -> Any:
        if self.ended:
            raise StopIteration(None)
        if not self._handed:
            self._handed = True
            return self._yielded
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self.ended:
            raise StopIteration(None)
        if not self._handed:  # cancelled before its first turn: what it waits for goes too,
            self._handed = True  # as it would had the task been waiting on it
            if isinstance(self._yielded, asyncio.Future):
                self._yielded.cancel()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)  # the three-argument form older callers use

    def close(self) -> None:
        if not self.ended:
            self._coro.close()

    def __await__(self) -> Any:  # pragma: no cover - only a task runs it
        raise TypeError("a started request is run by its task, not awaited")
