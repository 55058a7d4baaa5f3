"""Connecting to Redis or Redis Cluster from one URL, with every wait bounded; one round trip.

- ``open_client(url, cluster=None, socket_timeout=5.0, retries=3)`` → ``(client, is_cluster)``:
  a redis.asyncio ``Redis`` on a ``BoundedWaitPool`` (a bounded wait for a free
  connection, never an unbounded pool) or a ``RedisCluster``. TLS comes from ``rediss://``
  (``?ssl_ca_certs=…`` and the other redis-py TLS options in the query), ACL users from
  ``user:password@``. ``cluster=None`` takes ``?cluster=yes|no`` from the URL, else asks
  the server (``INFO cluster``). Connect and socket timeouts plus
  ``Retry(ExponentialBackoff(cap=1.0, base=0.05), retries)`` make a dead or frozen server
  fail in bounded time. redis-py errors are raised as they are; callers translate them
  (``tiers.redis.errors``).
- ``BoundedWaitPool`` — redis-py's ``BlockingConnectionPool`` that takes a free connection
  at once: its condition and timer (about 30 µs a command) only serve when all are busy.
- ``exchange(client, commands)`` → the replies of ``commands`` (tuples of command name and
  arguments: str, int, bytes-like, or ``Gathered``) sent back to back in one round trip,
  error replies returned as exception objects. On a single server it packs them itself and
  writes them on one pooled connection: redis-py's pipeline does the same with about 100 µs
  more bookkeeping per call (measured on the dev VM), more than a 64 KiB transfer costs.
  Connection errors are retried like redis-py's own calls (so every command sent must be
  safe to repeat); the replies share one moving deadline (no gap of more than
  ``socket_timeout``), not a timer each; a cancelled exchange closes its connection, never reused half read. On a
  cluster it is a cluster pipeline (routed per key, nodes in parallel).
- ``raise_first_error(replies)`` raises the first error reply of an ``exchange``.
- ``Gathered(parts)`` — one argument sent from several buffers back to back: no copy on a
  single server (a cluster pipeline gets them joined).
- ``take_cluster_option(url)`` → the URL without ``cluster=…``, and that choice.
- ``redact(url)`` → the URL with its password replaced by ``***`` (for messages).

Used by ``RedisTier.start`` and by ``RedisVersionRegistry`` when given a URL.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import hiredis
from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import MaxConnectionsError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from statetier.protocol.errors import ConfigError

MAX_CONNECTIONS = 64
_COPY_BELOW = 6000  # bytes: smaller arguments are copied into the command's framing
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}

Command = tuple[Any, ...]  # a command's name and arguments: str, int, bytes-like or ``Gathered``


class BoundedWaitPool(BlockingConnectionPool):
    """Waits (bounded by ``timeout``) for a connection only when every one is in use."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting = 0  # callers inside the blocking path, which a release must notify

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if not self._waiting and self.can_get_connection():
            try:  # the plain pool's path: no suspension before it holds a connection
                return await ConnectionPool.get_connection(self)  # type: ignore[no-untyped-call]
            except MaxConnectionsError:
                pass  # taken while this call waited for the pool's lock: wait like everyone
        self._waiting += 1
        try:
            return await super().get_connection()  # type: ignore[no-untyped-call]
        finally:
            self._waiting -= 1

    async def release(self, connection: Any) -> None:
        if self._waiting:
            await super().release(connection)
        else:
            await ConnectionPool.release(self, connection)


@dataclass(frozen=True, slots=True)
class Gathered:
    parts: tuple[Any, ...]  # bytes-like, sent in order as one value

    def joined(self) -> bytes:
        return b"".join(self.parts)


async def exchange(client: Redis | RedisCluster, commands: Sequence[Command]) -> list[Any]:
    """The replies to ``commands``, in order; an error reply is an exception object."""
    if isinstance(client, RedisCluster):
        async with client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*(a.joined() if isinstance(a, Gathered) else a for a in command))
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            return replies
    pool = client.connection_pool
    connection: Any = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        answered: list[Any] = await connection.retry.call_with_retry(
            lambda: _send_and_read(connection, commands), lambda error: connection.disconnect())
        return answered
    finally:
        await pool.release(connection)


async def _send_and_read(connection: Any, commands: Sequence[Command]) -> list[Any]:
    """Send ``commands`` back to back, read their replies. The wait for each reply is
    bounded by one deadline for the exchange, moved ahead (to ``socket_timeout`` from now)
    whenever less than half of it is left: no gap between replies lasts longer than
    ``socket_timeout``, and a reply costs no timer of its own (redis-py arms and cancels one
    per ``read_response``: a sixth of a whole-request lookup's CPU time)."""
    await connection.send_packed_command(_pack(commands))
    replies: list[Any] = []
    limit = connection.socket_timeout
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(None) as deadline:
            for _ in commands:
                if limit is not None:
                    now, when = loop.time(), deadline.when()
                    if when is None or when - now < limit / 2:
                        deadline.reschedule(now + limit)
                try:
                    replies.append(await connection.read_response(timeout=math.inf))
                except ResponseError as error:  # the reply was read: the connection stays in step
                    replies.append(error)
    except TimeoutError as exc:  # the deadline's (redis-py raises its own TimeoutError type)
        await connection.disconnect(nowait=True)  # half read: never reused
        raise RedisTimeoutError(f"Timeout reading from {connection.host}:{connection.port}") from exc
    return replies


def raise_first_error(replies: list[Any]) -> None:
    """Raise the first error reply of an ``exchange`` (they come back as exception objects)."""
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply


def _pack(commands: Sequence[Command]) -> list[Any]:
    """RESP arrays of bulk strings. hiredis packs a command of small arguments; a command
    with a large or gathered one is framed here, its large parts passed through uncopied."""
    out: list[Any] = []
    for command in commands:
        if _is_small(command):
            out.append(hiredis.pack_command(command))
        else:
            out += _frame(command)
    return out


def _is_small(command: Command) -> bool:
    for arg in command:
        kind = type(arg)
        if kind is str or kind is int:
            continue
        if kind is Gathered or (arg.nbytes if kind is memoryview else len(arg)) >= _COPY_BELOW:
            return False
    return True


def _frame(command: Command) -> list[Any]:
    out: list[Any] = []
    framing = bytearray(b"*%d\r\n" % len(command))
    for arg in command:
        parts = arg.parts if type(arg) is Gathered else (_encode(arg),)
        sizes = [memoryview(part).nbytes for part in parts]
        framing += b"$%d\r\n" % sum(sizes)
        for part, size in zip(parts, sizes):
            if size < _COPY_BELOW:
                framing += part
            else:
                out += (framing, part)
                framing = bytearray()
        framing += b"\r\n"
    out.append(framing)
    return out


def _encode(arg: object) -> bytes | bytearray | memoryview:
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int) and not isinstance(arg, bool):
        return b"%d" % arg
    if isinstance(arg, (bytes, bytearray, memoryview)):
        return arg
    raise TypeError(f"cannot send a {type(arg).__name__} to redis")


def take_cluster_option(url: str) -> tuple[str, bool | None]:
    """Remove ``cluster=…`` from the URL's query (redis-py does not know it)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    wanted = [value.lower() for name, value in query if name == "cluster"]
    if not wanted:
        return url, None
    if wanted[-1] not in _TRUE | _FALSE:
        raise ConfigError(f"redis URL option cluster={wanted[-1]!r}: expected yes or no")
    rest = urlencode([(name, value) for name, value in query if name != "cluster"])
    return urlunsplit(parts._replace(query=rest)), wanted[-1] in _TRUE


def redact(url: str) -> str:
    """The URL with its password hidden: what may appear in messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


async def open_client(url: str, *, cluster: bool | None = None, socket_timeout: float = 5.0,
                      retries: int = 3) -> tuple[Redis | RedisCluster, bool]:
    """Connect and return ``(client, is_cluster)``. Raises redis-py errors (callers translate)."""
    url, from_url = take_cluster_option(url)
    cluster = from_url if cluster is None else cluster
    options = dict(
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        max_connections=MAX_CONNECTIONS,
    )
    try:
        if not cluster:
            pool = BoundedWaitPool.from_url(url, timeout=socket_timeout, **options)
            plain = Redis.from_pool(pool)
            try:
                if cluster is None:
                    info = await plain.info("cluster")
                    cluster = bool(int(info.get("cluster_enabled", 0)))
                else:
                    await plain.ping()
            except BaseException:
                await plain.aclose()
                raise
            if not cluster:
                return plain, False
            await plain.aclose()
        client = RedisCluster.from_url(url, **options)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"redis URL {redact(url)!r}: {exc}") from exc
    try:
        await client.initialize()
    except BaseException:
        await client.aclose()
        raise
    return client, True
