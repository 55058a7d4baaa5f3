"""The daemon-wide byte budget: backpressure on inline payload bytes (DESIGN §7).

- ``ByteBudget(limit_bytes, wait_seconds, metrics=None)`` — one per daemon, shared by
  every connection. ``async with budget.hold(nbytes):`` admits ``nbytes`` of payload
  (an inline PUT's data, an inline LOAD's reply) and gives them back on exit.
- A request that does not fit waits in a FIFO queue for at most ``wait_seconds`` and
  then gets ``Busy`` (counted with ``metrics.count_busy()``). FIFO means no barging: a
  newcomer that would fit still queues behind earlier waiters, so a large request is
  never starved by a stream of small ones.
- A single request larger than the whole limit can never fit: it gets ``InvalidRequest``
  at once (retrying it is pointless, unlike ``Busy``).
- Cancellation-safe: a waiter that is cancelled or times out leaves the queue, and bytes
  granted to a waiter that was cancelled at the same moment go back to the budget.
- ``in_use``, ``limit``, ``waiting`` — read by ``Server.stats()``.

No polling: each waiter is a future resolved by ``release``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from statetier.daemon.metrics import Metrics, NullMetrics
from statetier.protocol.errors import Busy, InvalidRequest


@dataclass(eq=False, slots=True)
class _Waiter:
    nbytes: int
    granted: asyncio.Future


class ByteBudget:
    """Admits payload bytes up to ``limit_bytes``; see the module docstring."""

    def __init__(self, limit_bytes: int, wait_seconds: float, metrics: Metrics | NullMetrics | None = None) -> None:
        if limit_bytes <= 0:
            raise ValueError("limit_bytes must be positive")
        if wait_seconds < 0:
            raise ValueError("wait_seconds must not be negative")
        self.limit = limit_bytes
        self.wait_seconds = wait_seconds
        self._metrics = NullMetrics() if metrics is None else metrics
        self._in_use = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Hold ``nbytes`` for the body of the ``async with``."""
        await self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)

    async def acquire(self, nbytes: int) -> None:
        """Take ``nbytes``, waiting at most ``wait_seconds``; pair with ``release``."""
        if nbytes < 0:
            raise ValueError("nbytes must not be negative")
        if nbytes > self.limit:
            raise InvalidRequest(
                f"{nbytes} payload bytes exceed the daemon's whole byte budget of {self.limit}"
            )
        if self.try_acquire_nowait(nbytes):
            return
        if self.wait_seconds == 0:
            self._raise_busy(nbytes)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(nbytes, loop.create_future())
        self._waiters.append(waiter)
        timer = loop.call_later(self.wait_seconds, self._expire, waiter)
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled() and (
                waiter.granted.exception() is None
            ):
                self.release(nbytes)  # granted, but our caller was cancelled meanwhile
            else:
                self._forget(waiter)
            raise
        finally:
            timer.cancel()

    def try_acquire_nowait(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit now and nobody is queued; never waits."""
        if self._waiters or self._in_use + nbytes > self.limit:
            return False
        self._in_use += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Give back bytes taken by ``acquire``; wakes queued waiters that now fit."""
        if nbytes > self._in_use:
            raise RuntimeError(f"releasing {nbytes} bytes, but only {self._in_use} are held")
        self._in_use -= nbytes
        self._grant_waiters()

    def _grant_waiters(self) -> None:
        while self._waiters and self._in_use + self._waiters[0].nbytes <= self.limit:
            waiter = self._waiters.popleft()
            if waiter.granted.done():  # cancelled, its task has not run its cleanup yet
                continue
            self._in_use += waiter.nbytes
            waiter.granted.set_result(None)

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return
        self._grant_waiters()  # the one that left may have been blocking the head

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.granted.done():
            return
        try:
            self._raise_busy(waiter.nbytes)
        except Busy as exc:
            waiter.granted.set_exception(exc)
        self._forget(waiter)

    def _raise_busy(self, nbytes: int) -> None:
        self._metrics.count_busy()
        raise Busy(
            f"byte budget exhausted: {nbytes} bytes did not fit within {self.wait_seconds}s "
            f"({self._in_use} of {self.limit} bytes in use, {len(self._waiters)} waiting)"
        )
