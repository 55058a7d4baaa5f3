"""A batch of puts publishes through Redis with one commit (issue 25, item 5): counted.

32 puts of 64 KiB with ``publish`` from a host arena into a Redis tier: the commits of the
whole batch are one script call on the server (``INFO commandstats``, beside the registry's
claims), where each object used to take one; the published objects are whole for another node (its own engine over the
same Redis, nothing local), their versions in the registry's order, and a second batch of
the same streams supersedes the first one (the older refs are refused as stale).
"""

from __future__ import annotations

import os
import uuid

import pytest
from statetier.daemon.engine import Engine, EngineOptions, Publishing
from statetier.daemon.requests import Incoming, LoadRequest, PutRequest, PutResult
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import StaleState
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import Keyring
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.redis.registry import RedisVersionRegistry

from tests.support.redis_tier import erase_prefix

NS = NamespaceSpec("publish-batches").namespace()
KV = (TensorSpec("kv", "bfloat16", (2, 8, 16, 128)),)  # 64 KiB
ITEM = 64 * 1024
COUNT = 32


def script_calls(url: str) -> int:
    import redis

    with redis.Redis.from_url(url) as raw:
        return raw.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


async def node(url: str, prefix: str, keyring: Keyring, *, arena: bool) -> Engine:
    cross = RedisTier(RedisTierOptions(url, key_prefix=prefix), keyring=keyring)
    registry = RedisVersionRegistry(url, key_prefix=prefix)
    if not arena:
        engine = Engine([cross], keyring=keyring, registry=registry, options=EngineOptions(producer_id="decode"))
    else:
        host = HostTier(HostTierOptions(16 << 20, pin_memory=False))
        engine = Engine([host, cross], keyring=keyring, registry=registry, options=EngineOptions(producer_id="prefill"),
                        arena=host, publishing=Publishing(cross, cross, marks=cross))
    await engine.start()
    return engine


def batch(keys: list[StateKey], payloads: list[bytes], *, publish: bool = True) -> list[Incoming]:
    return [Incoming(PutRequest("default", key, Provenance("req-1"), KV, publish=publish), memoryview(data))
            for key, data in zip(keys, payloads)]


def fresh_keys() -> list[StateKey]:
    return [StateKey(NS, Kind.KV, layer, os.urandom(32), 0, 16) for layer in range(COUNT)]


@pytest.fixture
async def nodes(redis_server):
    keyring, prefix = Keyring.generate(), f"pubb-{uuid.uuid4().hex[:10]}"
    prefill = await node(redis_server.url, prefix, keyring, arena=True)
    decode = await node(redis_server.url, prefix, keyring, arena=False)
    yield prefill, decode
    await prefill.close()
    await decode.close()
    erase_prefix(redis_server.url, prefix)


async def test_a_published_batch_commits_in_one_script_call_and_keeps_version_order(nodes, redis_server):
    prefill, decode = nodes
    url = redis_server.url
    # the registry claims a batch's versions with a script call per stream: a batch that
    # does not publish counts those alone
    await prefill.put_batch(batch(fresh_keys(), [os.urandom(ITEM)] * COUNT, publish=False))  # scripts loaded
    before = script_calls(url)
    await prefill.put_batch(batch(fresh_keys(), [os.urandom(ITEM)] * COUNT, publish=False))
    claims = script_calls(url) - before

    keys = fresh_keys()
    first = [os.urandom(ITEM) for _ in keys]
    before = script_calls(url)
    results = await prefill.put_batch(batch(keys, first))
    assert all(isinstance(r, PutResult) and r.published and r.tier == "host" for r in results)
    assert script_calls(url) - before == claims + 1  # every commit of the batch in one call

    second = [os.urandom(ITEM) for _ in keys]
    newer = await prefill.put_batch(batch(keys, second))
    assert [r.ref.version for r in newer] == [r.ref.version + 1 for r in results]
    for old, new, data in zip(results, newer, second):
        with pytest.raises(StaleState):
            await decode.load(LoadRequest("default", NS, ref=old.ref), owner="d")
        loaded = await decode.load(LoadRequest("default", NS, ref=new.ref), owner="d")
        assert loaded.tier == "redis" and bytes(loaded.payload) == data
        await decode.release(loaded.lease_id, "d")
