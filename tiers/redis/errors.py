"""The one place where redis-py exceptions become statetier errors.

- ``translate_redis_error(exc, op)`` → the statetier error for a redis-py (or socket)
  exception met during ``op``:

      AuthenticationError, AuthorizationError, WRONGPASS / NOAUTH  → Unauthorized
      NoPermissionError (ACL NOPERM)                               → Forbidden
      OutOfMemoryError (maxmemory reached)                         → CapacityError
      ConnectionError, TimeoutError, ClusterDownError, TryAgain,
      BusyLoading, ReadOnly, cluster topology errors, OSError      → Unavailable
      any other RedisError                                         → InternalError

- ``RedisEdge`` — wraps every call of one tier or registry: ``with edge.call("read"):``
  translates what escapes (chained with ``from``) and keeps ``edge.is_available``, the
  flag the daemon exports as a gauge: false after an ``Unavailable``, true after any call
  that reached the server.

Wrong credentials are ``Unauthorized``, not ``Unavailable``: the server answered, and
retrying will not help until the URL changes.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

from redis import exceptions as rx

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


_FOREIGN = (rx.RedisError, rx.RedisClusterException, OSError, asyncio.TimeoutError)


class RedisEdge:
    """Translates at the edge and remembers whether the server was reachable last time."""

    def __init__(self) -> None:
        self.is_available = False
        self.unavailable_total = 0

    @contextlib.contextmanager
    def call(self, op: str) -> Iterator[None]:
        try:
            yield
        except _FOREIGN as exc:
            error = translate_redis_error(exc, op)
            if isinstance(error, Unavailable):
                self.is_available = False
                self.unavailable_total += 1
            else:
                self.is_available = True  # it answered, even if with a refusal
            raise error from exc
        self.is_available = True
