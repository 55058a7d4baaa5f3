"""Liveness, not suspicion: an owner fenced only on evidence its process is gone, and an
owner's entries announced again when the directory comes back empty.

- ``OwnerFences(directory, transport, faults)`` — the puller's side, local to it (a puller
  never withdraws another owner's entries). ``judge_lost(descriptor, exc)`` after a pull
  that failed ``PeerLost`` within its deadline (the transport redialled and retried
  already): the owner is fenced when another owner id answers at its address
  (``fenced_replaced``), its address refused the connection (``fenced_refused``) or its
  liveness key expired (``fenced_gone``); else it is only ``suspected`` (counted, said, the
  load goes on to the next copy, nothing fenced). ``judge_not_found(descriptor)`` fences an
  owner whose address another owner id answers. ``is_fenced(owner)``; ``reprobe()`` lifts
  the fence of every owner that renewed its liveness key since it was fenced (``unfenced``).
- ``OwnerAnnouncer(directory, options, faults, holds_locally)`` — the owner's side:
  ``record(descriptor)`` / ``discard(object_id)`` keep a bounded record of what this daemon
  published (``PUBLISHED``, each until its directory TTL); ``renew()`` sets this owner's
  liveness key again (a new value each time) and, when the key was gone (Redis restarted
  empty, or this daemon stalled past the liveness TTL), publishes again, pipelined
  (``Directory.republish``), every recorded descriptor whose object a local tier still holds
  (``reannounced``; a republish that failed is tried again at the next renewal).
- ``Liveness(announcer, fences, interval)`` — ``start()`` runs ``renew()`` then ``reprobe()``
  every ``interval`` (a third of the liveness TTL; every ``RENEW_WHILE_FAILING`` while the
  directory does not answer, so entries are announced again soon after it returns) until
  ``close()``, which drops the liveness key (a daemon that stops says so).
Every fault is counted in ``faults`` (``tiers.peer.faults``) and said at WARNING.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from statetier.protocol.errors import PeerLost, Unavailable
from statetier.protocol.lru import BoundedLru

from .directory import Descriptor, Directory
from .faults import PeerFaults
from .options import PeerTierOptions
from .transport import PeerTransport

log = logging.getLogger("statetier.peer")

FENCED = 4096  # owners fenced here (an owner id names one process: a restart is a new one)
PUBLISHED = 32768  # descriptors this daemon published, announced again after a directory loss
ALIVE_CHECK = 0.5  # seconds a failed pull waits for the owner's liveness key before it is answered
UNKNOWN = b"?"  # the liveness value when the directory did not say
RENEW_WHILE_FAILING = 0.5  # seconds between renewals while the directory does not answer


@dataclass(frozen=True, slots=True)
class _Fence:
    reason: str
    alive: bytes | None  # the owner's liveness value when fenced: a new one lifts the fence


class OwnerFences:
    def __init__(self, directory: Directory, transport: PeerTransport, faults: PeerFaults) -> None:
        self._directory = directory
        self._transport = transport
        self._faults = faults
        self._fenced: BoundedLru[str, _Fence] = BoundedLru(FENCED)

    def __len__(self) -> int:
        return len(self._fenced)

    def is_fenced(self, owner: str) -> bool:
        return owner in self._fenced

    async def judge_lost(self, descriptor: Descriptor, exc: PeerLost) -> None:
        owner, address = descriptor.owner, descriptor.address
        if self._judge_replaced(descriptor) or self.is_fenced(owner):
            return
        alive = await self._alive_value(owner)
        if isinstance(exc.__cause__, ConnectionRefusedError):
            self._fence(descriptor, _Fence("fenced_refused", alive), "peer %s (owner %s) refused the connection: no "
                        "process listens there; its entries are no longer offered here until it renews its liveness "
                        "key")
            return
        if alive is None:
            self._fence(descriptor, _Fence("fenced_gone", None), "peer %s (owner %s) did not answer and its liveness "
                        "key expired: its entries are no longer offered here until it renews the key")
            return
        self._faults.count("suspected", "peer %s (owner %s) did not answer the pull of %s within its deadline (%s), "
                           "but it renews its liveness key: not fenced; the load goes on to the next copy",
                           address, owner, descriptor.meta.object_id.hex(), exc.message)

    async def judge_not_found(self, descriptor: Descriptor) -> None:
        self._judge_replaced(descriptor)

    def _judge_replaced(self, descriptor: Descriptor) -> bool:
        answered = self._transport.answered_by(descriptor.address)
        if answered is None or answered == descriptor.owner or self.is_fenced(descriptor.owner):
            return False
        self._fenced.put(descriptor.owner, _Fence("fenced_replaced", None))
        self._faults.count("fenced_replaced", "peer %s now answers as owner %s, not %s (the daemon restarted): the "
                           "entries of %s are no longer offered here", descriptor.address, answered,
                           descriptor.owner, descriptor.owner)
        return True

    def _fence(self, descriptor: Descriptor, fence: _Fence, message: str) -> None:
        self._fenced.put(descriptor.owner, fence)
        self._transport.forget(descriptor.address)
        self._faults.count(fence.reason, message, descriptor.address, descriptor.owner)

    async def _alive_value(self, owner: str) -> bytes | None:
        """The owner's liveness value; a directory that does not answer within ``ALIVE_CHECK``
        is no evidence of death (a placeholder value: a fence then waits for any renewal)."""
        try:
            async with asyncio.timeout(ALIVE_CHECK):
                (value,) = await self._directory.alive_values([owner])
        except (Unavailable, TimeoutError):
            return UNKNOWN
        return value

    async def reprobe(self) -> None:
        owners = [owner for owner, _ in self._fenced.items()]
        if not owners:
            return
        values = await self._directory.alive_values(owners)
        for owner, value in zip(owners, values):
            fence = self._fenced.peek(owner)
            if fence is None or value is None or value == fence.alive or fence.reason == "fenced_replaced":
                continue
            self._fenced.discard(owner)
            self._faults.count("unfenced", "peer owner %s (fenced: %s) renewed its liveness key: its entries are "
                               "offered here again", owner, fence.reason)


class OwnerAnnouncer:
    def __init__(self, directory: Directory, options: PeerTierOptions, faults: PeerFaults,
                 holds_locally: Callable[[bytes], Awaitable[bool]]) -> None:
        self._directory = directory
        self._options = options
        self._faults = faults
        self._holds_locally = holds_locally
        self._published: BoundedLru[bytes, tuple[Descriptor, float]] = BoundedLru(PUBLISHED)
        self._renewed = False  # once: a key gone after it is a directory that lost it
        self._failing = False
        self._lost = False  # the directory lost this owner's entries; set until they are published again
        self.renewals = 0

    @property
    def is_failing(self) -> bool:
        return self._failing
    def record(self, descriptor: Descriptor) -> None:
        ttl = self._options.ttl_seconds
        self._published.put(descriptor.meta.object_id, (descriptor, float("inf") if ttl is None else
                                                        time.monotonic() + ttl))

    def discard(self, object_id: bytes) -> None:
        self._published.discard(object_id)

    async def renew(self) -> None:
        opts = self._options
        try:
            before = await self._directory.renew_alive(opts.owner_id, time.time_ns().to_bytes(8, "big"),
                                                       opts.liveness_ttl)
        except Unavailable as exc:
            if not self._failing:
                self._faults.count("renewal_failed", "peer directory unreachable: the liveness key of %s was not "
                                   "renewed (%s); peers fence this daemon if it stays so past %.1f s",
                                   opts.owner_id, exc.message, opts.liveness_ttl)
            self._failing = True
            return
        self._failing = False
        self.renewals += 1
        self._lost = self._lost or (before is None and self._renewed)
        self._renewed = True
        if self._lost:
            await self._reannounce()
            self._lost = False

    async def _reannounce(self) -> None:
        now = time.monotonic()
        kept = []
        for object_id, (descriptor, expires) in self._published.items():
            if expires > now and await self._holds_locally(object_id):
                kept.append(descriptor)
            else:
                self._published.discard(object_id)
        await self._directory.republish(kept)
        self._faults.count("reannounced", "peer directory lost the liveness key of %s (Redis restarted empty, or "
                           "this daemon stalled past %.1f s): %d descriptors of objects held here published again",
                           self._options.owner_id, self._options.liveness_ttl, len(kept))

    async def drop(self) -> None:
        with contextlib.suppress(Unavailable):
            await self._directory.drop_alive(self._options.owner_id)


class Liveness:
    def __init__(self, announcer: OwnerAnnouncer, fences: OwnerFences, interval: float) -> None:
        self.announcer = announcer
        self.fences = fences
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """The renewals start at once, in the background: a directory that does not answer
        delays no start."""
        self._task = asyncio.create_task(self._run(), name="peer-liveness")

    async def close(self) -> None:
        if self._task is not None:
            self._stopping.set()  # as well as the cancel: redis-py's connect now and then swallows one
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self._stopping.clear()
            await self.announcer.drop()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.announcer.renew()
                await self.fences.reprobe()
            except Unavailable as exc:
                log.debug("peer liveness: the directory is unreachable: %s", exc.message)
            except Exception:  # noqa: BLE001 - the loop outlives one bad turn; said, not swallowed
                log.exception("peer liveness: a renewal failed")
            failing = self.announcer.is_failing
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(),
                                       min(self._interval, RENEW_WHILE_FAILING) if failing else self._interval)
