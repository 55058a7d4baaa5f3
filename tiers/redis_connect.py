"""Connecting to Redis or Redis Cluster from one URL, with every wait bounded.

- ``open_client(url, cluster=None, socket_timeout=5.0, retries=3)`` → ``(client, is_cluster)``:
  a redis.asyncio ``Redis`` on a ``BlockingConnectionPool`` (a bounded wait for a free
  connection, never an unbounded pool) or a ``RedisCluster``. TLS comes from ``rediss://``
  (``?ssl_ca_certs=…`` and the other redis-py TLS options in the query), ACL users from
  ``user:password@``. ``cluster=None`` takes ``?cluster=yes|no`` from the URL, else asks
  the server (``INFO cluster``). Connect and socket timeouts plus
  ``Retry(ExponentialBackoff(cap=1.0, base=0.05), retries)`` make a dead or frozen server
  fail in bounded time. redis-py errors are raised as they are; callers translate them
  (``tiers.redis_errors``).
- ``take_cluster_option(url)`` → the URL without ``cluster=…``, and that choice.
- ``redact(url)`` → the URL with its password replaced by ``***`` (for messages).

Used by ``RedisTier.start`` and by ``RedisVersionRegistry`` when given a URL.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from statetier.protocol.errors import ConfigError

MAX_CONNECTIONS = 64
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


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
            pool = BlockingConnectionPool.from_url(url, timeout=socket_timeout, **options)
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
