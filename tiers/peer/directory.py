"""The directory: where a published object lives, in Redis, a few hundred bytes an object.

- ``Descriptor`` — an object as the directory knows it: the daemon that holds it
  (``owner``, its peer ``address``), its index entry (``ObjectMeta``) and its signed
  header (``header``: what a lookup can show without the bytes).
- ``Directory(url, ttl_seconds, socket_timeout)`` — ``publish(descriptor)`` (one round
  trip: the entry under its key, and by object id for a load by ref); ``republish(descriptors)``
  (any number of them again, one round trip per ``REPUBLISH_BATCH``, with the full TTL: the
  directory came back empty); ``find(digests)``
  (one round trip for any number of keys: an HGETALL each, pipelined); ``get(object_id)``;
  ``withdraw(object_id, key_digest)`` (this daemon's own entry, on delete: only an owner
  withdraws its entries, a puller never does). Liveness (``tiers.peer.liveness``):
  ``renew_alive(owner, value, ttl)`` (this owner's key set again; what it held before, None
  when it was gone), ``alive_values(owners)`` (one round trip), ``drop_alive(owner)``.
  Redis errors become ``Unavailable`` here, chained. ``commands``, ``round_trips`` and
  ``bytes_sent`` count what it sent (the benchmark's per-handoff figures).

Keys: ``st:peer:dir:{key digest}`` (hash: object id → descriptor) and
``st:peer:obj:{object id}``, both with the TTL of the published object;
``st:peer:alive:{owner id}`` (a value its owner changes at every renewal, with the liveness TTL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from statetier.protocol.errors import Unavailable
from statetier.protocol.identity import Kind
from statetier.tiers.base import ObjectMeta


@dataclass(frozen=True, slots=True)
class Descriptor:
    owner: str
    address: str
    meta: ObjectMeta
    header: bytes

    def encode(self) -> bytes:
        m = self.meta
        return msgspec.msgpack.encode((
            self.owner, self.address, m.object_id, m.key_digest, m.stream_id, m.version, int(m.kind), m.size,
            m.header_len, m.created_at_ns, m.request_id, m.step, m.speculative, m.namespace, m.tenant, self.header))

    @classmethod
    def decode(cls, raw: bytes) -> "Descriptor":
        (owner, address, oid, key, stream, version, kind, size, header_len, created, request_id, step, spec,
         namespace, tenant, header) = msgspec.msgpack.decode(raw)
        meta = ObjectMeta(oid, key, stream, version, Kind(kind), size, header_len, created, request_id, step, spec,
                          namespace=namespace, tenant=tenant)
        return cls(owner, address, meta, header)


REPUBLISH_BATCH = 2048  # descriptors per round trip of a republish (each well within the socket timeout)


def _dir_key(key_digest: bytes) -> str:
    return f"st:peer:dir:{key_digest.hex()}"


def _obj_key(object_id: bytes) -> str:
    return f"st:peer:obj:{object_id.hex()}"


def _alive_key(owner: str) -> str:
    return f"st:peer:alive:{owner}"


class Directory:
    def __init__(self, url: str, ttl_seconds: int | None, socket_timeout: float = 5.0) -> None:
        self._url = url
        self._ttl = ttl_seconds
        self._timeout = socket_timeout
        self._client: Redis | None = None
        self.commands = 0
        self.round_trips = 0
        self.bytes_sent = 0

    async def start(self) -> None:
        self._client = Redis.from_url(self._url, socket_timeout=self._timeout, socket_connect_timeout=self._timeout)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        if self._client is None:
            raise RuntimeError("the directory is not started")
        self.commands += len(commands)
        self.round_trips += 1
        self.bytes_sent += sum(len(a) if isinstance(a, (bytes, str)) else 8 for c in commands for a in c)
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                return list(await pipe.execute())
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the peer directory in Redis: {exc}") from exc

    async def publish(self, descriptor: Descriptor) -> None:
        await self._pipeline(self._publish_commands(descriptor))

    async def republish(self, descriptors: Sequence[Descriptor]) -> None:
        for start in range(0, len(descriptors), REPUBLISH_BATCH):
            await self._pipeline([c for d in descriptors[start:start + REPUBLISH_BATCH]
                                  for c in self._publish_commands(d)])

    def _publish_commands(self, descriptor: Descriptor) -> list[tuple[Any, ...]]:
        raw, m = descriptor.encode(), descriptor.meta
        commands: list[tuple[Any, ...]] = [("HSET", _dir_key(m.key_digest), m.object_id, raw),
                                           ("SET", _obj_key(m.object_id), raw)]
        if self._ttl is not None:
            commands += [("EXPIRE", _dir_key(m.key_digest), self._ttl), ("EXPIRE", _obj_key(m.object_id), self._ttl)]
        return commands

    async def find(self, key_digests: Sequence[bytes]) -> list[list[Descriptor]]:
        if not key_digests:
            return []
        replies = await self._pipeline([("HGETALL", _dir_key(d)) for d in key_digests])
        return [[Descriptor.decode(raw) for raw in (reply or {}).values()] for reply in replies]

    async def get(self, object_id: bytes) -> Descriptor | None:
        (raw,) = await self._pipeline([("GET", _obj_key(object_id))])
        return None if raw is None else Descriptor.decode(raw)

    async def withdraw(self, object_id: bytes, key_digest: bytes) -> None:
        await self._pipeline([("HDEL", _dir_key(key_digest), object_id), ("DEL", _obj_key(object_id))])

    async def renew_alive(self, owner: str, value: bytes, ttl_seconds: float) -> bytes | None:
        old, _ = await self._pipeline([("GET", _alive_key(owner)),
                                       ("SET", _alive_key(owner), value, "PX", max(1, int(ttl_seconds * 1000)))])
        return None if old is None else bytes(old)

    async def alive_values(self, owners: Sequence[str]) -> list[bytes | None]:
        if not owners:
            return []
        (values,) = await self._pipeline([("MGET", *(_alive_key(o) for o in owners))])
        return list(values)

    async def drop_alive(self, owner: str) -> None:
        await self._pipeline([("DEL", _alive_key(owner))])
