"""Bounded waits on state a test cannot order by a reply or an event.

- ``wait_until(predicate, what, timeout=…, interval=…)`` — calls ``predicate()`` until it
  returns something truthy and returns that value; after ``timeout`` seconds an
  ``AssertionError`` that names ``what`` and the last value seen.
- ``await eventually(predicate, what, timeout=…, interval=…)`` — the same on the event
  loop; ``predicate`` may be a plain function or a coroutine function (awaited each poll).

Use them for effects that happen in the background (another process, a cleanup task, a
scrape); where the code under test offers an event or a reply to await, await that instead.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT = 20.0


def wait_until(predicate: Callable[[], T], what: str = "the condition", *, timeout: float = DEFAULT_TIMEOUT,
               interval: float = 0.05) -> T:
    """See the module docstring."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:g} s (last seen: {last!r})")
        time.sleep(interval)


async def eventually(predicate: Callable[[], T | Awaitable[T]], what: str = "the condition", *,
                     timeout: float = DEFAULT_TIMEOUT, interval: float = 0.01) -> T:
    """See the module docstring."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        last = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last  # type: ignore[return-value]
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:g} s (last seen: {last!r})")
        await asyncio.sleep(interval)
