"""What the Redis tier tests share: objects, raw clients and the keys the tier writes.

- ``KEYRING``, ``NAMESPACE`` — what ``make_object(size, …)`` seals a KV page under.
- ``Backend(url, is_cluster)`` — a server or a cluster and a redis-py client on it (``raw``);
  the ``backend`` and ``make_tier`` fixtures that use it are in ``tests/tiers/conftest.py``.
- ``object_keys(raw, prefix, object_id)`` — every key of one object; ``keys_of(tier)`` — the
  tier's ``RedisKeys``.
"""

from __future__ import annotations

import os
import time

import redis
import redis.cluster

from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, new_state_id
from statetier.protocol.keyring import Keyring, dev_keyring
from statetier.protocol.sealed import decode_header, seal_object
from statetier.tiers.base import ObjectMeta
from statetier.tiers.redis import RedisTier
from statetier.tiers.redis.layout import RedisKeys

KEYRING = dev_keyring()
NAMESPACE = NamespaceSpec("redis-tier-test").namespace()


def make_object(size: int, *, keyring: Keyring = KEYRING, layer: int = 0,
                request_id: str = "req") -> tuple[ObjectMeta, bytes]:
    """A sealed KV page with ``size`` random payload bytes, and its metadata."""
    key = StateKey(NAMESPACE, Kind.KV, layer, bytes(32), 0, 16)
    blob = seal_object(key, Provenance(request_id, 0, "test", time.time_ns()),
                       [(TensorSpec("kv", "uint8", (size,)), os.urandom(size))],
                       keyring=keyring, state_id=new_state_id(), version=1)
    return ObjectMeta.from_header(decode_header(blob)), blob


def raw_client(url: str, is_cluster: bool):
    return redis.cluster.RedisCluster.from_url(url) if is_cluster else redis.Redis.from_url(url)


def object_keys(raw, prefix: str, object_id: bytes) -> list[bytes]:
    return sorted(raw.scan_iter(match=f"{prefix}:{{{object_id.hex()}}}:*", count=1000))


def keys_of(tier: RedisTier) -> RedisKeys:
    return RedisKeys(tier.key_prefix)


class Backend:
    def __init__(self, url: str, is_cluster: bool) -> None:
        self.url, self.is_cluster = url, is_cluster
        self.raw = raw_client(url, is_cluster)


def erase_prefix(url: str, prefix: str) -> None:
    """Every key a Redis tier with ``prefix`` wrote on the server behind ``url``."""
    with redis.Redis.from_url(url) as raw:
        for pattern in (f"{prefix}:*", f"{{{prefix}}}:*"):
            for name in list(raw.scan_iter(match=pattern, count=500)):
                raw.delete(name)
