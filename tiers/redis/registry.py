"""The version registry in Redis: versions stay monotonic across every node (DESIGN §4).

``RedisVersionRegistry(client_or_url, key_prefix="st", ttl_seconds=None)`` implements
``tiers.registry.VersionRegistry``. ``claim`` is one Lua compare-and-set on the stream's
own key ``st:v:{<stream_id hex>}`` (a hash: version, state_id), so it is atomic on a single
server and on Redis Cluster alike, and two nodes claiming at once never get the same
version. The state_id → stream record ``st:s:{<state_id hex>}`` lives in another slot and
is written by a second command after the CAS. ``claim_many`` sends a batch's scripts and
records in one pipeline (one round trip; a server runs them in order, so claims of one
stream keep theirs); claims made after a stale one are withdrawn (a second round trip, only
then). ``withdraw`` puts a superseded head back with a compare-and-set of its own, so a
claim that another node made meanwhile is left alone.

A claim without a version whose ``past`` is above the head (a head rolled back under the
claimer) first sets the head to ``past``, in the same script, so its version is above both.
A claim is idempotent for its state_id: a retry after a lost reply returns the version
already recorded instead of a second one (or a ``StaleState``). Versions are compared
as decimal strings in Lua, so every u64 is exact.

``newest_many`` asks for many heads in one round trip; ``head_commands``/``heads_from`` let
a ``RedisTier`` on the same server (``lives_on``) carry those commands in a round trip of
its own (a lookup's manifests and heads travel together).

Pass the client of a started ``RedisTier`` (``tier.client``) to share its connections,
or a URL: the registry then connects on first use and closes in ``close()``. ``edge``: the
tier's (``tier.edge``), so every call is held to its deadline and fails at once while the
tier's health probe has the server marked down; by default an edge of its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from statetier.protocol.errors import InvalidRequest, StaleState

from ..registry import Claim, Claimed, StreamHead, VersionRegistry
from .connect import exchange, open_client, take_cluster_option
from .errors import RedisEdge
from .layout import RedisKeys

MAX_VERSION = (1 << 64) - 1

# KEYS[1]: the stream head. ARGV: state_id, version ('' = next), ttl seconds (0 = none), past
# ('' or absent = none: a next version is above it too).
# Returns {1, version, previous version, previous state_id} when claimed (or already claimed
# by this state_id: previous = itself), {0, newest} when stale. No previous head: '0', ''.
CLAIM_LUA = """
local head = redis.call('HMGET', KEYS[1], 'version', 'state_id')
local newest, holder = head[1] or '0', head[2]
if holder == ARGV[1] and (ARGV[2] == '' or ARGV[2] == newest) then
  return {1, newest, newest, holder}
end
local version = ARGV[2]
if version == '' then
  local past = ARGV[4] or ''
  if #past > #newest or (#past == #newest and past > newest) then
    redis.call('HSET', KEYS[1], 'version', past)
  end
  redis.call('HINCRBY', KEYS[1], 'version', 1)
  version = redis.call('HGET', KEYS[1], 'version')
else
  if #version < #newest or (#version == #newest and version <= newest) then
    return {0, newest}
  end
  redis.call('HSET', KEYS[1], 'version', version)
end
redis.call('HSET', KEYS[1], 'state_id', ARGV[1])
if tonumber(ARGV[3]) > 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return {1, version, newest, holder or ''}
"""

# KEYS[1]: the stream head. ARGV: the withdrawn claim's state_id, the previous version ('0':
# none), the previous state_id. Puts the previous head back only while the claim is the head.
WITHDRAW_LUA = """
if redis.call('HGET', KEYS[1], 'state_id') ~= ARGV[1] then
  return 0
end
if ARGV[2] == '0' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'version', ARGV[2], 'state_id', ARGV[3])
end
return 1
"""


class RedisVersionRegistry(VersionRegistry):
    def __init__(self, client_or_url: Redis | RedisCluster | str, *, key_prefix: str = "st",
                 ttl_seconds: int | None = None, socket_timeout: float = 5.0, retries: int = 3,
                 edge: RedisEdge | None = None) -> None:
        self._url = client_or_url if isinstance(client_or_url, str) else None
        self._client: Redis | RedisCluster | None = None if isinstance(client_or_url, str) else client_or_url
        self._owns_client = self._url is not None
        self._keys = RedisKeys(key_prefix)
        self._ttl = ttl_seconds
        self._socket_timeout, self._retries = socket_timeout, retries
        self._script: AsyncScript | None = None
        self._connecting: asyncio.Lock | None = None
        self._edge = edge if edge is not None else RedisEdge(socket_timeout)

    @property
    def is_available(self) -> bool:
        return self._edge.is_available

    async def claim(self, stream_id: bytes, state_id: bytes, version: int | None = None) -> int:
        if version is not None and not (isinstance(version, int) and 0 <= version <= MAX_VERSION):
            raise InvalidRequest(f"version must be an integer in [0, 2^64), not {version!r}")
        client, script = await self._ready()
        async with self._edge.call("claim"):
            claimed, value, *_ = await script(
                keys=[self._keys.stream_head(stream_id)],
                args=[state_id, "" if version is None else str(version), self._ttl or 0])
        if not claimed:
            newest = int(value)
            raise StaleState(f"version {version} is not newer than the registry's {newest}",
                             newest_version=newest)
        async with self._edge.call("claim"):
            await client.set(self._keys.stream_of(state_id), stream_id, ex=self._ttl)
        return int(value)

    async def claim_many(self, claims: list[Claim]) -> list[Claimed | StaleState | None]:
        for claim in claims:
            if claim.version is not None and not (isinstance(claim.version, int) and 0 <= claim.version <= MAX_VERSION):
                raise InvalidRequest(f"version must be an integer in [0, 2^64), not {claim.version!r}")
        if not claims:
            return []
        client, script = await self._ready()
        commands = []
        for claim in claims:
            commands.append(("EVALSHA", script.sha, 1, *self._claim_args(claim)))
            commands.append(self._stream_of_command(claim))
        async with self._edge.call("claim"):
            replies = await exchange(client, commands)
            answers = [await self._claim_reply(script, claim, reply) for claim, reply in zip(claims, replies[::2])]
            for reply in replies[1::2]:
                if isinstance(reply, BaseException):
                    raise reply
        out: list[Claimed | StaleState | None] = []
        late = []  # made after a stale claim: the batch ends there, so they are withdrawn
        for claim, answer in zip(claims, answers):
            if out and not isinstance(out[-1], Claimed):
                if isinstance(answer, Claimed):
                    late.append((claim, answer))
                out.append(None)
                continue
            out.append(answer)
        if late:
            await self.withdraw(late)
        return out

    async def withdraw(self, claims: list[tuple[Claim, Claimed]]) -> None:
        if not claims:
            return
        client, _ = await self._ready()
        commands = []
        for claim, claimed in reversed(claims):  # the latest first: each restores what it superseded
            previous = claimed.previous
            commands.append(("EVAL", WITHDRAW_LUA, 1, self._keys.stream_head(claim.stream_id), claim.state_id,
                             str(previous.version) if previous else "0", previous.state_id if previous else b""))
        async with self._edge.call("claim"):
            for reply in await exchange(client, commands):
                if isinstance(reply, BaseException):
                    raise reply

    def _claim_args(self, claim: Claim) -> tuple[Any, ...]:
        return (self._keys.stream_head(claim.stream_id), claim.state_id,
                "" if claim.version is None else str(claim.version), self._ttl or 0,
                "" if claim.past is None else str(claim.past))

    def _stream_of_command(self, claim: Claim) -> tuple[Any, ...]:
        key = self._keys.stream_of(claim.state_id)
        return ("SET", key, claim.stream_id, "EX", self._ttl) if self._ttl else ("SET", key, claim.stream_id)

    async def _claim_reply(self, script: AsyncScript, claim: Claim, reply: Any) -> Claimed | StaleState:
        if isinstance(reply, NoScriptError):  # a restarted server lost its script cache: none ran
            key, *args = self._claim_args(claim)
            reply = await script(keys=[key], args=args)
        elif isinstance(reply, BaseException):
            raise reply
        if not int(reply[0]):
            newest = int(reply[1])
            return StaleState(f"version {claim.version} is not newer than the registry's {newest}",
                              newest_version=newest)
        previous = int(reply[2])
        return Claimed(int(reply[1]), StreamHead(previous, bytes(reply[3])) if previous else None)

    async def newest(self, stream_id: bytes) -> StreamHead | None:
        client, _ = await self._ready()
        async with self._edge.call("newest"):
            version, state_id = await client.hmget(self._keys.stream_head(stream_id), "version", "state_id")
        if version is None or state_id is None:
            return None
        return StreamHead(int(version), _as_bytes(state_id))

    async def newest_many(self, stream_ids: list[bytes]) -> list[StreamHead | None]:
        if not stream_ids:
            return []
        client, _ = await self._ready()
        async with self._edge.call("newest"):
            replies = await exchange(client, self.head_commands(stream_ids))
        return self.heads_from(replies)

    async def read_many(self, stream_ids: list[bytes], state_ids: list[bytes]
                        ) -> tuple[list[StreamHead | None], list[bytes | None]]:
        if not stream_ids and not state_ids:
            return [], []
        client, _ = await self._ready()
        commands = self.head_commands(stream_ids) + [("GET", self._keys.stream_of(s)) for s in state_ids]
        async with self._edge.call("newest"):
            replies = await exchange(client, commands)
            streams = []
            for reply in replies[len(stream_ids):]:
                if isinstance(reply, BaseException):
                    raise reply
                streams.append(bytes(reply) if reply is not None else None)
        return self.heads_from(replies[: len(stream_ids)]), streams

    def head_commands(self, stream_ids: list[bytes]) -> list[tuple[Any, ...]]:
        """The commands that read these streams' heads (for ``connect.exchange``)."""
        return [("HMGET", self._keys.stream_head(stream), "version", "state_id") for stream in stream_ids]

    def heads_from(self, replies: list[Any]) -> list[StreamHead | None]:
        """The heads in the replies to ``head_commands``; an error reply is raised (translated)."""
        heads: list[StreamHead | None] = []
        with self._edge.call("newest"):
            for reply in replies:
                if isinstance(reply, BaseException):
                    raise reply
                version, state_id = reply
                heads.append(None if version is None or state_id is None else StreamHead(int(version), bytes(state_id)))
        return heads

    def lives_on(self, url: str | None, client: Redis | RedisCluster | None) -> bool:
        """Whether this registry's keys are on the server behind ``url`` or ``client``."""
        if self._client is not None and self._client is client:
            return True
        if self._url is None or url is None:
            return False
        return take_cluster_option(self._url)[0] == take_cluster_option(url)[0]

    async def stream_of(self, state_id: bytes) -> bytes | None:
        client, _ = await self._ready()
        async with self._edge.call("stream_of"):
            stream = await client.get(self._keys.stream_of(state_id))
        return _as_bytes(stream) if stream is not None else None

    async def close(self) -> None:
        client, self._script = self._client, None
        if self._owns_client and client is not None:
            self._client = None
            await client.aclose()

    async def _ready(self) -> tuple[Redis | RedisCluster, AsyncScript]:
        if self._script is not None and self._client is not None:
            return self._client, self._script
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            client = self._client
            if client is None:
                assert self._url is not None  # a registry given a client keeps it until close
                async with self._edge.call("connect"):
                    client, _ = await open_client(self._url, socket_timeout=self._socket_timeout,
                                                  retries=self._retries)
                self._client = client
            if self._script is None:
                self._script = client.register_script(CLAIM_LUA)
            return client, self._script


def _as_bytes(value: bytes | str) -> bytes:
    """A reply as bytes (the clients here never decode replies; a str is not expected)."""
    return value.encode() if isinstance(value, str) else bytes(value)
