"""The one place where redis-py exceptions become statetier errors.

- ``translate_redis_error(exc, op)`` → the statetier error for a redis-py (or socket)
  exception met during ``op``:

      AuthenticationError, AuthorizationError, WRONGPASS / NOAUTH  → Unauthorized
      NoPermissionError (ACL NOPERM)                               → Forbidden
      OutOfMemoryError (maxmemory reached)                         → CapacityError
      ConnectionError, TimeoutError, ClusterDownError, TryAgain,
      BusyLoading, ReadOnly, cluster topology errors, OSError      → Unavailable
      any other RedisError                                         → InternalError

- ``RedisEdge(deadline)`` — wraps every call of one tier or registry: ``async with
  edge.call("read"):`` holds it to one deadline (retries included), fails it at once while
  the health probe has the server marked down, and translates what escapes (chained with
  ``from``); it keeps ``edge.is_available``, the flag the daemon exports as a gauge: false
  after an ``Unavailable``, true after any call that reached the server. A tier and its
  registry share one edge, so one probe speaks for both.

Wrong credentials are ``Unauthorized``, not ``Unavailable``: the server answered, and
retrying will not help until the URL changes.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from redis import exceptions as rx
from redis.exceptions import TimeoutError as RedisTimeout

from statetier.protocol.errors import (
    CapacityError,
    Forbidden,
    InternalError,
    StatetierError,
    Unauthorized,
    Unavailable,
)

_UNREACHABLE = (
    rx.ConnectionError,  # includes BusyLoadingError, MaxConnectionsError
    rx.TimeoutError,
    rx.ClusterDownError,  # includes MasterDownError
    rx.TryAgainError,
    rx.ReadOnlyError,  # a replica promoted under us: the master moved
    rx.RedisClusterException,  # no reachable startup node, slot not covered
    OSError,
    asyncio.TimeoutError,
)
# redis-py 5 lacks the newer classes; a missing one is simply not matched.
_AUTH = tuple(getattr(rx, name) for name in
              ("AuthenticationError", "AuthorizationError", "AuthenticationWrongNumberOfArgsError")
              if hasattr(rx, name))
_PROGRAMMING = tuple(getattr(rx, name) for name in ("CrossSlotTransactionError", "InvalidPipelineStack")
                     if hasattr(rx, name))


def translate_redis_error(exc: BaseException, op: str) -> StatetierError:
    """The statetier error for ``exc``, met while doing ``op`` (used in the message)."""
    if isinstance(exc, _AUTH):
        return Unauthorized(f"redis refused the credentials of the configured URL during {op}: {exc}")
    if isinstance(exc, rx.NoPermissionError):
        return Forbidden(f"the redis ACL user may not {op}: {exc}")
    if isinstance(exc, rx.OutOfMemoryError):
        return CapacityError(f"redis is out of memory (maxmemory) during {op}: {exc}")
    if isinstance(exc, _PROGRAMMING):
        return InternalError(f"redis {op}: {exc}")
    if isinstance(exc, _UNREACHABLE):
        return Unavailable(f"redis unavailable during {op}: {exc}")
    return InternalError(f"redis {op} failed: {exc}")


FOREIGN_ERRORS = (rx.RedisError, rx.RedisClusterException, OSError, asyncio.TimeoutError)
_FOREIGN = FOREIGN_ERRORS


class RedisEdge:
    """Translates at the edge, bounds every call, and keeps what is known of the server.

    ``call(op)`` is a context manager both ways: ``with`` translates what escapes (for code
    that only reads replies already in hand); ``async with`` also holds the call to one
    deadline (``deadline`` seconds, every retry and the wait for a pooled connection
    included: what a hung server may cost a call) and, while the health probe says the
    server is down (``mark_down``), fails at once without a round trip. ``is_available`` is
    the flag the daemon exports (false after an ``Unavailable``, true after any call that
    reached the server); ``is_down`` the probe's verdict, cleared by ``mark_up``.
    """

    def __init__(self, deadline: float | None = None) -> None:
        self.deadline = deadline
        self.is_available = False
        self.is_down = False
        self.unavailable_total = 0
        self.refused_while_down = 0  # calls failed at once: the probe had marked the server down

    def call(self, op: str) -> _EdgeCall:
        return _EdgeCall(self, op)

    def mark_down(self) -> None:
        self.is_down, self.is_available = True, False

    def mark_up(self) -> None:
        self.is_down, self.is_available = False, True

    def translated(self, exc: BaseException, op: str) -> StatetierError:
        error = translate_redis_error(exc, op)
        if isinstance(error, Unavailable):
            self.is_available = False
            self.unavailable_total += 1
        else:
            self.is_available = True  # it answered, even if with a refusal
        return error


class _EdgeCall:
    """One call through a ``RedisEdge`` (see there)."""

    __slots__ = ("edge", "op", "_timeout")

    def __init__(self, edge: RedisEdge, op: str) -> None:
        self.edge, self.op = edge, op
        self._timeout: asyncio.Timeout | None = None

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.edge.is_available = True
        elif isinstance(exc, _FOREIGN):
            raise self.edge.translated(exc, self.op) from exc

    async def __aenter__(self) -> None:
        edge = self.edge
        if edge.is_down:
            edge.refused_while_down += 1
            raise Unavailable(f"redis unavailable during {self.op}: the health probe found it down "
                              f"(not tried; the probe reconnects)")
        if edge.deadline is not None:
            self._timeout = asyncio.timeout(edge.deadline)
            await self._timeout.__aenter__()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        timeout, self._timeout = self._timeout, None
        if timeout is not None:
            try:
                await timeout.__aexit__(kind, exc, tb)
            except TimeoutError as expired:
                raise self.edge.translated(
                    RedisTimeout(f"Timeout: no answer within the call's deadline of {self.edge.deadline:g} s"),
                    self.op) from expired
        self.__exit__(kind, exc, tb)
