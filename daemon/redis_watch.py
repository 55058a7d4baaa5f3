"""The Redis health probe: what ``statetier_redis_up`` and ``/readyz`` say, and the reconnect.

``RedisWatch(tier, registry, metrics, interval)`` — built by ``daemon.app`` when a Redis tier
is configured; ``await run()`` is one of the app's maintenance tasks. Every ``interval``
seconds it asks ``tier.probe()`` (one PING, or the connect a degraded start still owes,
bounded by the tier's probe timeout). The probe marks the tier's edge, which the version
registry shares: while Redis is down every Redis call fails at once instead of waiting for
its deadline. A probe that fails marks the registry's outage (``mark_outage``: versions and
reads come from this daemon's own view, publish is refused); one that answers writes the
claims made meanwhile back into Redis (``reconcile``), then reads the cluster's purge marks
and hands them to ``on_purge_marks`` (the engine's ``PurgeMarks.take``: it removes the copies
new ones name; the engine also reads them before each load and lookup, so a purge on another
daemon is honoured from this one's next load or lookup on, and swept within a probe interval
when none comes). Each change sets
``statetier_redis_up`` at once and is logged.

``readiness()`` → a ``daemon.http.Readiness``: ready; or degraded — still serving, so
``/readyz`` stays 200 and only ``/readyz/strict`` answers 503 —, its body naming what is
still served during the outage and since when (``DEGRADED_SERVES``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from statetier.protocol.errors import StatetierError
from statetier.tiers.base import PurgeMarkStore
from statetier.tiers.tolerant_registry import TolerantRegistry

from .http import Readiness
from .metrics import Metrics, NullMetrics

log = logging.getLogger("statetier")

DEGRADED_SERVES = ("served: loads and lookups of copies this daemon holds (when it holds the newest version it "
                   "knows), puts without publish (versions from this daemon, written to Redis when it answers)\n"
                   "refused: puts with publish=true (RegistryUnavailable), loads of objects held only in Redis "
                   "or by other daemons\n")


class Probed(PurgeMarkStore, Protocol):
    """The shared Redis tier, as the watch sees it: probed, and keeping the purge marks."""

    async def probe(self) -> bool: ...


class RedisWatch:
    def __init__(self, tier: Probed, registry: TolerantRegistry, metrics: Metrics | NullMetrics,
                 interval: float) -> None:
        self.tier, self.registry, self.metrics, self.interval = tier, registry, metrics, interval
        self.is_up: bool | None = None  # None: not probed yet
        self.down_since: float | None = None  # wall clock of the change to down
        self.changes = 0
        self.on_purge_marks: Callable[[dict[str, int]], Awaitable[object]] | None = None

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval)

    async def check(self) -> bool:
        """One probe, and what follows from it; whether Redis answered."""
        is_up = await self.tier.probe()
        if is_up:
            try:
                pending = await self.registry.reconcile()
            except StatetierError as exc:  # it answered the PING, not the claims: still degraded
                log.warning("redis answers, but writing back the claims made during the outage failed: %s", exc)
                pending = -1
            if pending:
                is_up = False
            else:
                await self._honour_purges()
        else:
            self.registry.mark_outage()
        self._set(is_up)
        return is_up

    async def _honour_purges(self) -> None:
        """New purge marks (another daemon's purges): this daemon's copies they name removed."""
        if self.on_purge_marks is None:
            return
        try:
            await self.on_purge_marks(await self.tier.purge_marks())  # only new marks are acted on
        except StatetierError as exc:
            log.warning("reading or honouring the cluster's purge marks failed (next probe retries): %s", exc)

    def _set(self, is_up: bool) -> None:
        self.metrics.set_redis_available(is_up)
        if is_up == self.is_up:
            return
        if self.is_up is not None:
            self.changes += 1
        self.is_up = is_up
        self.down_since = None if is_up else time.time()
        if is_up and self.changes:
            registry = self.registry
            log.warning("redis is back: %d claims made during the outage written back, %d lost to newer ones",
                        registry.reconciled, registry.lost)

    def readiness(self) -> Readiness:
        if self.is_up is not False:
            return Readiness(True)
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.down_since or time.time()))
        return Readiness(True, degraded=True, body=f"degraded: redis unreachable since {since}\n{DEGRADED_SERVES}")
