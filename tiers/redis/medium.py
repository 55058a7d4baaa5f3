"""The medium of the Redis tier: one client, and every call the parts make through it.

- ``RedisMedium(options, keyring, cipher, executor)`` — the seam every part of
  ``RedisTier`` reaches Redis through (as redis-py's commands reach their connection
  through ``execute_command``): ``client`` (``RuntimeError`` until started), ``edge`` (the
  error translation, ``tiers.redis.errors``), ``keys`` (``tiers.redis.layout``),
  ``scripts``; the parts send their commands with ``connect.exchange(medium.client, …)``
  (one round trip), or ``exchange_touching`` (the object's LRU touch riding along when
  there is a budget); ``account(op, …)`` (the accounting script; ``objects`` and
  ``bytes_used`` as Redis last reported them); ``run(fn)`` (the executor, for large
  envelopes and joins).
  ``start()`` connects, loads the scripts and proves the ACL user may touch the keys (a
  server that does not answer: ``Unavailable``, or with ``start_unreachable="degraded"`` a
  start without it, the edge marked down); ``probe()`` is one bounded health check (PING,
  or that connect) that marks the edge up or down; ``close()`` closes the client.
- ``Sightings`` — what this node last saw of Redis (``medium.seen``): object ids seen
  stored (``known``, so ``prepare_store`` refuses a duplicate without a round trip) and
  manifests a lookup fetched (``found``, each serving the lease that follows), both
  ``BoundedLru``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, Callable

from redis.asyncio import Redis, RedisCluster

from statetier.protocol.errors import StatetierError, Unavailable
from statetier.protocol.keyring import Keyring
from statetier.protocol.lru import BoundedLru

from ..crypto import AtRestCipher
from . import connect
from .connect import open_client, redact
from .errors import FOREIGN_ERRORS, RedisEdge
from .layout import Manifest, RedisKeys
from .options import RedisTierOptions
from .scripts import Scripts

log = logging.getLogger("statetier.redis")

_KNOWN_IDS = 1 << 16  # object ids remembered as stored, for prepare_store's refusal
_FOUND_KEPT = 1 << 14  # manifests kept for the leases that follow a lookup


class Sightings:
    """See the module docstring."""

    def __init__(self) -> None:
        self.known: BoundedLru[bytes, bool] = BoundedLru(_KNOWN_IDS)
        self.found: BoundedLru[bytes, tuple[Manifest, float]] = BoundedLru(_FOUND_KEPT)

    def remember(self, object_id: bytes, stored: bool) -> None:
        """Keep what this node last saw of an object (for ``prepare_store``)."""
        if stored:
            self.known.put(object_id, True)
        else:
            self.known.discard(object_id)
            self.found.discard(object_id)


class RedisMedium:
    """See the module docstring."""

    def __init__(self, options: RedisTierOptions, keyring: Keyring, cipher: AtRestCipher | None,
                 executor: concurrent.futures.Executor | None) -> None:
        self.options = options
        self.keyring = keyring
        self.cipher = cipher
        self.keys = RedisKeys(options.key_prefix)
        self.accounting_keys = self.keys.accounting()
        self.edge = RedisEdge(options.socket_timeout)
        self.seen = Sightings()
        self.is_cluster: bool | None = None
        self.objects = self.bytes_used = 0  # as Redis reported on the last accounting call
        self._executor, self._owns_executor = executor, executor is None
        self._client: Redis | RedisCluster | None = None
        self._scripts: Scripts | None = None
        self.is_awaiting_server = False  # started without a server (degraded): ``probe`` connects

    @property
    def client(self) -> Redis | RedisCluster:
        if self._client is None:
            if self.is_awaiting_server:
                raise Unavailable(f"redis unavailable: {redact(self.options.url)} has not answered since start")
            raise RuntimeError(f"tier {self.options.name!r} is not started (or already closed)")
        return self._client

    @property
    def scripts(self) -> Scripts:
        if self._scripts is None:
            raise RuntimeError(f"tier {self.options.name!r} is not started (or already closed)")
        return self._scripts

    @property
    def is_started(self) -> bool:
        return self._client is not None

    async def start(self) -> None:
        if self._client is not None:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"{self.options.name}-tier")
        try:
            await self._connect()
        except Unavailable as exc:
            if self.options.start_unreachable == "refuse":
                raise
            log.warning("%s; starting without it (degraded), the health probe reconnects", exc)
            self.is_awaiting_server = True
            self.edge.mark_down()

    async def probe(self) -> bool:
        """One health check (a PING, or a connect when none succeeded yet), bounded by
        ``options.probe_timeout``; marks the edge up or down and says which."""
        was_down = self.edge.is_down
        try:
            async with asyncio.timeout(self.options.probe_timeout):
                if self._client is None:
                    if not self.is_awaiting_server:
                        return False  # closed
                    self.edge.is_down = False  # the connect's own calls must go out; others meet no client yet
                    await self._connect()
                    self.is_awaiting_server = False
                else:
                    await self._client.ping()
        except (Unavailable, *FOREIGN_ERRORS) as exc:
            if not was_down:
                log.warning("redis health probe: %s is down (%s)", redact(self.options.url), exc or "no answer")
            self.edge.mark_down()
            return False
        except StatetierError:
            self.edge.mark_down()  # it answered, but refuses us (credentials, ACL): not serving
            return False
        if was_down:
            log.warning("redis health probe: %s answers again", redact(self.options.url))
        self.edge.mark_up()
        return True

    async def _connect(self) -> None:
        options = self.options
        async with self.edge.call("connect"):
            client, self.is_cluster = await open_client(options.url, cluster=options.cluster,
                                                        socket_timeout=options.socket_timeout,
                                                        retries=options.retries)
        self._scripts = Scripts(client)
        try:
            self._client = client
            async with self.edge.call("connect"):
                await self._scripts.load_all()
            await self.account("status")  # also proves the ACL user may touch our keys
        except BaseException:
            self._client = None
            await client.aclose()
            raise

    def take_client(self) -> Redis | RedisCluster | None:
        """The client, which the tier stops using now (``close``); None when not started."""
        client, self._client = self._client, None
        return client

    async def close(self, client: Redis | RedisCluster | None) -> None:
        """Close ``client`` (what ``take_client`` gave) and the executor this medium made."""
        if client is not None:
            await client.aclose()
        if self._owns_executor and self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def account(self, op: str, object_id: bytes = b"", size: int = 0,
                      client: Redis | RedisCluster | None = None) -> int:
        """The accounting script's ``op`` (``client``: one the tier is closing with)."""
        keys, args = self.accounting_keys, [op, object_id.hex(), size, self.options.ttl_seconds or 0]
        async with self.edge.call(f"accounting {op}"):
            (reply,) = await connect.exchange(client or self.client, [self.scripts.command("accounting", keys, args)])
            changed, used, count = await self.scripts.result_of(reply, "accounting", keys, args)
        self.bytes_used, self.objects = int(used), int(count)
        return int(changed)

    async def exchange_touching(self, object_id: bytes, commands: list[tuple[Any, ...]]) -> list[Any]:
        """``exchange`` of ``commands`` and, with a budget, the object's LRU touch (whose
        reply updates the accounting and is not returned)."""
        if self.options.capacity_bytes is None:  # LRU order only matters to eviction
            return await connect.exchange(self.client, commands)
        touch = ["touch", object_id.hex(), 0, self.options.ttl_seconds or 0]
        keys = self.accounting_keys
        replies = await connect.exchange(self.client, [*commands, self.scripts.command("accounting", keys, touch)])
        _, used, count = await self.scripts.result_of(replies.pop(), "accounting", keys, touch)
        self.bytes_used, self.objects = int(used), int(count)
        return replies
