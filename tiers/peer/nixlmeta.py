"""A NIXL agent's metadata in the directory, signed with the cluster keyring.

- ``sign(keyring, agent, metadata) -> bytes`` — the blob a daemon publishes:
  ``key_id(8) n(1) agent(n) HMAC(K, "statetier/nixl-metadata/1" | key_id | n | agent | metadata)(32)
  metadata`` under the peer-auth key ``K`` of ``tiers.peer.wire`` (the same handshake key,
  never the signing key itself).
- ``verify(keyring, agent, blob) -> bytes`` — the metadata, once the MAC verifies under a key
  of this keyring and the blob names ``agent``; else ``Unauthorized`` (nothing of it reaches
  NIXL: a forged blob is never ``add_remote_agent``'ed).
- ``MetadataBoard(url, ttl_seconds)`` — ``publish(agent, blob)`` under
  ``st:peer:nixl:{agent}`` with the directory's TTL, ``fetch(agent)`` (None when absent).
  Redis errors become ``Unavailable``.
"""

from __future__ import annotations

import hmac
import struct

from redis.asyncio import Redis
from redis.exceptions import RedisError

from statetier.protocol.errors import Unauthorized, Unavailable
from statetier.protocol.keyring import Keyring

from . import wire

CONTEXT = b"statetier/nixl-metadata/1"
HEAD = struct.Struct("<8sB")


def _tag(key: bytes, key_id: bytes, name: bytes, metadata: bytes) -> bytes:
    return wire.mac(key, CONTEXT, key_id, bytes([len(name)]), name, metadata)


def sign(keyring: Keyring, agent: str, metadata: bytes) -> bytes:
    active = keyring.active
    name = agent.encode()
    if len(name) > 255:
        raise ValueError(f"a NIXL agent name of {len(name)} bytes (at most 255)")
    key = wire.auth_key(active)
    return HEAD.pack(active.key_id, len(name)) + name + _tag(key, active.key_id, name, metadata) + metadata


def verify(keyring: Keyring, agent: str, blob: bytes) -> bytes:
    if len(blob) < HEAD.size:
        raise Unauthorized(f"peer: the NIXL metadata of {agent} is truncated")
    key_id, n = HEAD.unpack_from(blob)
    name_end = HEAD.size + n
    name, tag, metadata = blob[HEAD.size:name_end], blob[name_end:name_end + wire.MAC_BYTES], \
        blob[name_end + wire.MAC_BYTES:]
    key = wire.key_for(keyring, key_id)  # Unauthorized: a key this cluster does not hold
    if len(tag) != wire.MAC_BYTES or not hmac.compare_digest(_tag(key, key_id, name, metadata), tag):
        raise Unauthorized(f"peer: the NIXL metadata of {agent} does not verify under this cluster's keyring")
    if name != agent.encode():
        raise Unauthorized(f"peer: the NIXL metadata published for {agent} names {name!r}")
    return metadata


def board_key(agent: str) -> str:
    return f"st:peer:nixl:{agent}"


class MetadataBoard:
    def __init__(self, url: str, ttl_seconds: int | None, socket_timeout: float = 5.0) -> None:
        self._url = url
        self._ttl = ttl_seconds
        self._timeout = socket_timeout
        self._client: Redis | None = None

    async def start(self) -> None:
        self._client = Redis.from_url(self._url, socket_timeout=self._timeout,
                                      socket_connect_timeout=self._timeout)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _redis(self) -> Redis:
        if self._client is None:
            raise RuntimeError("the NIXL metadata board is not started")
        return self._client

    async def publish(self, agent: str, blob: bytes) -> None:
        try:
            await self._redis().set(board_key(agent), blob, ex=self._ttl)
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the peer directory in Redis (NIXL metadata): {exc}") from exc

    async def fetch(self, agent: str) -> bytes | None:
        try:
            raw = await self._redis().get(board_key(agent))
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the peer directory in Redis (NIXL metadata): {exc}") from exc
        return None if raw is None else raw if isinstance(raw, bytes) else raw.encode()
