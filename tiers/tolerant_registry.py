"""The version registry through an outage of the shared one (DESIGN §5: Redis is a tier, not
a dependency of the local path).

``TolerantRegistry(shared, *, on_outage="local" | "refuse", max_streams=…)`` is a
``VersionRegistry`` over a shared one (``RedisVersionRegistry``):

- While the shared registry answers, every call goes to it, and what it answers (each head
  claimed or read, each state_id's stream) is mirrored here (a bounded ``MemoryVersionRegistry``).
- A call that meets ``Unavailable`` is answered from the mirror: reads (``newest``,
  ``newest_many``, ``read_many``, ``stream_of``) with the newest version this daemon knows,
  so a load is never served an older version than one this daemon claimed or saw (the
  staleness promise); claims, with ``on_outage="local"``, take the next version above the
  newest known here (and above ``past``) — a stream's first one in an outage
  ``OUTAGE_STRIDE`` ahead, above any claim still on its way to Redis — and wait in
  ``pending`` for the shared registry, or with ``"refuse"`` raise ``RegistryUnavailable``.
  ``local_answers`` counts both. Once a call met the outage, none goes to the shared
  registry until ``reconcile`` (the probe's, when Redis answers again) succeeds.
- ``reconcile()`` (the daemon's health probe calls it when Redis answers again) writes each
  pending claim into the shared registry with its exact version, a compare-and-set that
  takes it only when newer than the shared head. A claim another daemon beat (its head as
  new or newer) is ``lost`` (counted): fencing then refuses loads by ref of it as stale.
- ``is_degraded``: calls meet an outage (``mark_outage``, or the last call failed), or
  claims wait; ``mark_outage`` lets the probe say so before any call fails.
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

from statetier.protocol.errors import RegistryUnavailable, StaleState, Unavailable

from .registry import Claim, Claimed, MemoryVersionRegistry, StreamHead, VersionRegistry

T = TypeVar("T")

MAX_PENDING = 1 << 16  # claims made during one outage, at most; past it, refused
OUTAGE_STRIDE = 1 << 16  # how far ahead a stream's first version in an outage is taken


class TolerantRegistry(VersionRegistry):
    """See the module docstring."""

    def __init__(self, shared: VersionRegistry, *, on_outage: Literal["local", "refuse"] = "local",
                 max_streams: int = 1 << 20) -> None:
        self.shared = shared
        self.on_outage = on_outage
        self.mirror = MemoryVersionRegistry(max_streams)
        self.pending: dict[bytes, tuple[Claim, int]] = {}  # state_id -> its claim, the version taken
        self.local_answers = self.lost = self.reconciled = 0
        self._outage = False
        self._jumped: set[bytes] = set()  # streams whose outage versions are ahead already

    @property
    def is_degraded(self) -> bool:
        return self._outage or bool(self.pending)

    def mark_outage(self) -> None:
        self._outage = True

    # ------------------------------------------------------------------ claims

    async def claim(self, stream_id: bytes, state_id: bytes, version: int | None = None) -> int:
        (answer,) = await self.claim_many([Claim(stream_id, state_id, version)])
        if isinstance(answer, StaleState):
            raise answer
        assert answer is not None  # a batch of one is always answered
        return answer.version

    async def claim_many(self, claims: list[Claim]) -> list[Claimed | StaleState | None]:
        if self._outage:  # until reconcile: a claim sent now could land after those made here
            return self._claim_locally(claims, Unavailable("redis unavailable during claim"))
        try:
            answers = await self.shared.claim_many(claims)
        except Unavailable as exc:
            return self._claim_locally(claims, exc)
        self._outage = False
        for claim, answer in zip(claims, answers):
            if isinstance(answer, Claimed):
                self._mirror(claim.stream_id, StreamHead(answer.version, claim.state_id), claim.state_id)
        return answers

    def _claim_locally(self, claims: list[Claim], exc: Unavailable) -> list[Claimed | StaleState | None]:
        self._outage = True
        if self.on_outage == "refuse":
            raise RegistryUnavailable(f"{exc.message}; registry.on_outage = \"refuse\": no version is claimed "
                                      f"while the shared registry is unreachable, nothing was stored") from exc
        if len(self.pending) + len(claims) > MAX_PENDING:
            raise RegistryUnavailable(f"{exc.message}; {len(self.pending)} claims already wait for it") from exc
        answers = self._local_claims(claims)
        for claim, answer in zip(claims, answers):
            if isinstance(answer, Claimed):
                self.pending[claim.state_id] = (claim, answer.version)
        self.local_answers += len(claims)
        return answers

    def _local_claims(self, claims: list[Claim]) -> list[Claimed | StaleState | None]:
        out: list[Claimed | StaleState | None] = []
        for claim in claims:
            if out and not isinstance(out[-1], Claimed):
                out.append(None)
                continue
            out.append(self.mirror.claim_now(self._fenced(claim)))
        return out

    def _fenced(self, claim: Claim) -> Claim:
        """The first claim of a stream in an outage takes a version ``OUTAGE_STRIDE`` ahead:
        claims that were on their way when Redis stopped answering may still be made there
        (a frozen server runs them when it wakes), each one version ahead of what was known;
        this one must be newer than all of them, or reconcile would find it lost."""
        if claim.version is not None or claim.stream_id in self._jumped:
            return claim
        self._jumped.add(claim.stream_id)
        head = self.mirror.head_now(claim.stream_id)
        known = max(head.version if head else 0, claim.past or 0)
        return replace(claim, past=known + OUTAGE_STRIDE - 1)

    async def withdraw(self, claims: list[tuple[Claim, Claimed]]) -> None:
        local = [(c, a) for c, a in claims if self.pending.pop(c.state_id, None) is not None]
        self._jumped.difference_update(c.stream_id for c, _ in local)  # the next claim jumps again
        shared = [(c, a) for c, a in claims if (c, a) not in local]
        if shared:
            await self.shared.withdraw(shared)
        await self.mirror.withdraw(claims)

    # ------------------------------------------------------------------ reads

    async def newest(self, stream_id: bytes) -> StreamHead | None:
        return (await self.newest_many([stream_id]))[0]

    async def newest_many(self, stream_ids: list[bytes]) -> list[StreamHead | None]:
        try:
            heads = await self._shared_unless_outage(self.shared.newest_many(stream_ids))
        except Unavailable:
            self._outage = True
            self.local_answers += len(stream_ids)
            return await self.mirror.newest_many(stream_ids)
        self._outage = False
        return [self._newer_of(stream, head) for stream, head in zip(stream_ids, heads)]

    async def read_many(self, stream_ids: list[bytes], state_ids: list[bytes]
                        ) -> tuple[list[StreamHead | None], list[bytes | None]]:
        try:
            heads, streams = await self._shared_unless_outage(self.shared.read_many(stream_ids, state_ids))
        except Unavailable:
            self._outage = True
            self.local_answers += len(stream_ids) + len(state_ids)
            return await self.mirror.read_many(stream_ids, state_ids)
        self._outage = False
        for state_id, stream in zip(state_ids, streams):
            if stream is not None:
                self.mirror.remember_stream(state_id, stream)
        return [self._newer_of(s, head) for s, head in zip(stream_ids, heads)], streams

    async def stream_of(self, state_id: bytes) -> bytes | None:
        return (await self.read_many([], [state_id]))[1][0]

    # ------------------------------------------------------------------ reconnect

    async def reconcile(self) -> int:
        """Write the pending claims into the shared registry; how many are still pending.
        ``Unavailable`` leaves the rest for the next call."""
        while self.pending:
            items = list(self.pending.items())
            claims = [replace(claim, version=version, past=None) for _, (claim, version) in items]
            try:
                answers = await self.shared.claim_many(claims)
            except Unavailable:
                self._outage = True
                return len(self.pending)
            for (state_id, _), answer in zip(items, answers):
                if answer is None:
                    break  # after a lost one: the next round makes it
                del self.pending[state_id]
                if isinstance(answer, StaleState):
                    self.lost += 1
                else:
                    self.reconciled += 1
        self._outage = False
        self._jumped.clear()
        return 0

    async def close(self) -> None:
        await self.shared.close()

    async def _shared_unless_outage(self, call: Coroutine[Any, Any, T]) -> T:
        """The shared registry's answer; during an outage (until ``reconcile``) none is asked."""
        if self._outage:
            call.close()
            raise Unavailable("redis unavailable: answered from this daemon's view until the probe reconnects")
        return await call

    def _mirror(self, stream: bytes, head: StreamHead, state_id: bytes) -> None:
        self.mirror.remember(stream, head)
        self.mirror.remember_stream(state_id, stream)

    def _newer_of(self, stream: bytes, head: StreamHead | None) -> StreamHead | None:
        """The shared head, mirrored; a pending claim of this stream that is newer wins."""
        if head is not None:
            self.mirror.remember(stream, head)
        return self.mirror.head_now(stream) if self.pending else head
