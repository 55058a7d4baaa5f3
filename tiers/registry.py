"""The version registry: which attempt of a stream is the newest, and whose state_id is whose.

DESIGN §4: the sealing daemon assigns each put of a stream the next version through the
registry; a put whose version is not newer than the registry's is refused (``StaleState``),
so a late write-behind or a second connector path never overwrites newer state. The
registry also records, per state_id, the stream it was issued for (``MisroutedState``).

- ``VersionRegistry``       — the interface (``claim``, ``newest``, ``newest_many``,
  ``stream_of``).
- ``MemoryVersionRegistry`` — one process; bounded (oldest streams forgotten past a limit).
- ``RedisVersionRegistry``  — in ``tiers.redis.registry``: across nodes, atomic in Redis.
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


class VersionRegistry(abc.ABC):
    #: True when answers come from this process's memory (no I/O): see ``Tier.answers_in_memory``.
    answers_in_memory: bool = False

    @abc.abstractmethod
    async def claim(self, stream_id: bytes, state_id: bytes, version: int | None = None) -> int:
        """Record ``state_id`` as the newest attempt of ``stream_id`` and return its version.

        ``version=None`` takes the next one (newest + 1, or 1). A given version that is not
        newer than the newest known raises ``StaleState``.
        """

    @abc.abstractmethod
    async def newest(self, stream_id: bytes) -> StreamHead | None: ...

    async def newest_many(self, stream_ids: list[bytes]) -> list[StreamHead | None]:
        """``newest`` of each stream, in order (a registry behind the network: one round trip)."""
        return [await self.newest(stream) for stream in stream_ids]

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
        head = self._heads.peek(stream_id)
        newest = head.version if head else 0
        if version is None:
            version = newest + 1
        elif version <= newest:
            raise StaleState(f"version {version} is not newer than the registry's {newest}")
        self._heads.put(stream_id, StreamHead(version, state_id))
        self._streams.put(state_id, stream_id)
        return version

    async def newest(self, stream_id: bytes) -> StreamHead | None:
        return self._heads.peek(stream_id)

    async def stream_of(self, state_id: bytes) -> bytes | None:
        return self._streams.peek(state_id)
