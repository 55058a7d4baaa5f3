"""The version registry: which attempt of a stream is the newest, and whose state_id is whose.

DESIGN §4: the sealing daemon assigns each put of a stream the next version through the
registry; a put whose version is not newer than the registry's is refused (``StaleState``),
so a late write-behind or a second connector path never overwrites newer state. The
registry also records, per state_id, the stream it was issued for (``MisroutedState``).

- ``VersionRegistry``       — the interface (``claim``, ``claim_many``, ``withdraw``,
  ``newest``, ``newest_many``, ``stream_of``, ``read_many``).
- ``Claim`` — one claim of a batch (stream, state_id, version or None, and ``past``: the
  newest version its claimer saw, which a next version must exceed even when the registry's
  head is behind it, rolled back); ``Claimed`` — its version and the head it superseded
  (what ``withdraw`` puts back).
- ``MemoryVersionRegistry`` — one process; bounded (oldest streams forgotten past a limit).
  ``claim_now``/``head_now`` without awaiting; ``remember``/``remember_stream`` feed it what
  another registry answered (a mirror).
- ``RedisVersionRegistry``  — in ``tiers.redis.registry``: across nodes, atomic in Redis.
- ``TolerantRegistry``      — in ``tiers.tolerant_registry``: a shared registry and, through
  its outages, this process's mirror of it (``is_degraded``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from statetier.protocol.errors import StaleState
from statetier.protocol.lru import BoundedLru


@dataclass(frozen=True, slots=True)
class StreamHead:
    version: int
    state_id: bytes


@dataclass(frozen=True, slots=True)
class Claim:
    stream_id: bytes
    state_id: bytes
    version: int | None = None  # None: the next one
    past: int | None = None  # a version the claimer saw: one taken as the next one is above it too


@dataclass(frozen=True, slots=True)
class Claimed:
    version: int
    previous: StreamHead | None  # the head this claim superseded (None: the stream was new)


class VersionRegistry(abc.ABC):
    #: True when answers come from this process's memory (no I/O): see ``Tier.answers_in_memory``.
    answers_in_memory: bool = False

    @property
    def is_degraded(self) -> bool:
        """True while a shared registry is unreachable and answers come from what this
        process knows (``tiers.tolerant_registry``); a registry of one process never is."""
        return False

    @abc.abstractmethod
    async def claim(self, stream_id: bytes, state_id: bytes, version: int | None = None) -> int:
        """Record ``state_id`` as the newest attempt of ``stream_id`` and return its version.

        ``version=None`` takes the next one (newest + 1, or 1). A given version that is not
        newer than the newest known raises ``StaleState``.
        """

    @abc.abstractmethod
    async def claim_many(self, claims: list[Claim]) -> list[Claimed | StaleState | None]:
        """The claims of a batch, in order, in one call (one round trip behind the network).
        A claim without a version takes the next one, and one above its ``past``. The first
        stale claim ends the batch: its answer is the ``StaleState``; the claims after it are
        not made (``None``). Claims of one stream are made in the given order."""

    @abc.abstractmethod
    async def withdraw(self, claims: list[tuple[Claim, Claimed]]) -> None:
        """Undo claims whose objects were never stored (a batch that failed after claiming):
        a stream whose head is still the claim's state_id gets its previous head back. One call."""

    @abc.abstractmethod
    async def newest(self, stream_id: bytes) -> StreamHead | None: ...

    async def newest_many(self, stream_ids: list[bytes]) -> list[StreamHead | None]:
        """``newest`` of each stream, in order (a registry behind the network: one round trip)."""
        return [await self.newest(stream) for stream in stream_ids]

    async def read_many(self, stream_ids: list[bytes], state_ids: list[bytes]
                        ) -> tuple[list[StreamHead | None], list[bytes | None]]:
        """``newest`` of each stream and ``stream_of`` of each state_id, in one call (what a
        batch of loads by ref asks; one round trip behind the network)."""
        return ([await self.newest(stream) for stream in stream_ids],
                [await self.stream_of(state_id) for state_id in state_ids])

    @abc.abstractmethod
    async def stream_of(self, state_id: bytes) -> bytes | None: ...

    async def close(self) -> None:
        return None


class MemoryVersionRegistry(VersionRegistry):
    answers_in_memory = True

    def __init__(self, max_streams: int = 1_000_000) -> None:
        self.max_streams = max_streams
        self._heads: BoundedLru[bytes, StreamHead] = BoundedLru(max_streams)
        self._streams: BoundedLru[bytes, bytes] = BoundedLru(max_streams)

    async def claim(self, stream_id: bytes, state_id: bytes, version: int | None = None) -> int:
        claimed = self.claim_now(Claim(stream_id, state_id, version))
        if isinstance(claimed, StaleState):
            raise claimed
        return claimed.version

    async def claim_many(self, claims: list[Claim]) -> list[Claimed | StaleState | None]:
        out: list[Claimed | StaleState | None] = []
        for claim in claims:
            if out and not isinstance(out[-1], Claimed):
                out.append(None)
                continue
            out.append(self.claim_now(claim))
        return out

    async def withdraw(self, claims: list[tuple[Claim, Claimed]]) -> None:
        for claim, claimed in reversed(claims):  # the latest first: each restores what it superseded
            head = self._heads.peek(claim.stream_id)
            if head is None or head.state_id != claim.state_id:
                continue
            if claimed.previous is None:
                self._heads.discard(claim.stream_id)
            else:
                self._heads.put(claim.stream_id, claimed.previous)
            self._streams.discard(claim.state_id)

    def claim_now(self, claim: Claim) -> Claimed | StaleState:
        previous = self._heads.peek(claim.stream_id)
        newest = previous.version if previous else 0
        version = claim.version
        if version is None:
            version = max(newest, claim.past or 0) + 1
        elif version <= newest:
            return StaleState(f"version {version} is not newer than the registry's {newest}", newest_version=newest)
        self._heads.put(claim.stream_id, StreamHead(version, claim.state_id))
        self._streams.put(claim.state_id, claim.stream_id)
        return Claimed(version, previous)

    async def newest(self, stream_id: bytes) -> StreamHead | None:
        return self._heads.peek(stream_id)

    async def stream_of(self, state_id: bytes) -> bytes | None:
        return self._streams.peek(state_id)

    def remember(self, stream_id: bytes, head: StreamHead) -> None:
        """Take ``head`` as the stream's newest unless a newer one is held (a mirror's feed)."""
        held = self._heads.peek(stream_id)
        if held is None or head.version >= held.version:
            self._heads.put(stream_id, head)

    def head_now(self, stream_id: bytes) -> StreamHead | None:
        return self._heads.peek(stream_id)

    def remember_stream(self, state_id: bytes, stream_id: bytes) -> None:
        self._streams.put(state_id, stream_id)

    async def newest_many(self, stream_ids: list[bytes]) -> list[StreamHead | None]:
        return [self._heads.peek(stream) for stream in stream_ids]

    async def read_many(self, stream_ids: list[bytes], state_ids: list[bytes]
                        ) -> tuple[list[StreamHead | None], list[bytes | None]]:
        return [self._heads.peek(s) for s in stream_ids], [self._streams.peek(s) for s in state_ids]
