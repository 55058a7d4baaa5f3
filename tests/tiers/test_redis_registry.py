"""The Redis version registry: one ordering of versions for every node, on one server or a cluster.

Two registries on two separate clients stand for two nodes. They must agree on the newest
version of a stream, never hand out one version twice however their claims interleave,
refuse a version that is not newer (naming the newest), and remember which stream each
state_id was claimed for.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest

from statetier.protocol.errors import InvalidRequest, StaleState
from statetier.protocol.identity import new_state_id
from statetier.protocol.keyring import dev_keyring
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.redis.registry import RedisVersionRegistry
from statetier.tiers.registry import StreamHead

_prefixes = itertools.count()


@pytest.fixture(params=["single", "cluster"])
def url(request) -> str:
    if request.param == "single":
        return request.getfixturevalue("redis_server").url
    return request.getfixturevalue("redis_cluster").url


@pytest.fixture
async def two_nodes(url):
    prefix = f"r{os.getpid()}x{next(_prefixes)}"
    node_a = RedisVersionRegistry(url, key_prefix=prefix)
    node_b = RedisVersionRegistry(url, key_prefix=prefix)
    yield node_a, node_b
    await node_a.close()
    await node_b.close()


def stream() -> bytes:
    return os.urandom(16)


async def test_claims_count_up_and_both_nodes_see_the_newest(two_nodes) -> None:
    node_a, node_b = two_nodes
    s, first, second = stream(), new_state_id(), new_state_id()
    assert await node_a.newest(s) is None
    assert await node_a.claim(s, first) == 1
    assert await node_b.claim(s, second) == 2
    assert await node_a.newest(s) == StreamHead(2, second)
    assert await node_b.stream_of(first) == s
    assert await node_a.stream_of(second) == s
    assert await node_a.stream_of(new_state_id()) is None


async def test_a_version_that_is_not_newer_is_stale_and_names_the_newest(two_nodes) -> None:
    node_a, node_b = two_nodes
    s = stream()
    assert await node_a.claim(s, new_state_id(), version=7) == 7
    for late in (7, 6, 0):
        with pytest.raises(StaleState, match="registry's 7"):
            await node_b.claim(s, new_state_id(), version=late)
    assert await node_b.claim(s, new_state_id()) == 8
    big = (1 << 64) - 2  # u64 versions compare exactly, past what a Lua double holds
    assert await node_a.claim(s, new_state_id(), version=big) == big
    with pytest.raises(StaleState):
        await node_b.claim(s, new_state_id(), version=big - 1)
    with pytest.raises(InvalidRequest):
        await node_a.claim(s, new_state_id(), version=1 << 64)


async def test_a_repeated_claim_of_one_state_id_returns_its_version(two_nodes) -> None:
    node_a, node_b = two_nodes
    s, sid = stream(), new_state_id()
    assert await node_a.claim(s, sid, version=3) == 3
    assert await node_b.claim(s, sid, version=3) == 3  # a retry after a lost reply
    assert await node_b.claim(s, sid) == 3
    assert await node_a.claim(s, new_state_id()) == 4


async def test_concurrent_claims_from_two_nodes_never_share_a_version(two_nodes) -> None:
    node_a, node_b = two_nodes
    s = stream()
    claims = [node.claim(s, new_state_id()) for _ in range(100) for node in (node_a, node_b)]
    versions = await asyncio.gather(*claims)
    assert sorted(versions) == list(range(1, 201))

    explicit = [node.claim(s, new_state_id(), version=500) for node in (node_a, node_b) for _ in range(10)]
    outcomes = await asyncio.gather(*explicit, return_exceptions=True)
    assert outcomes.count(500) == 1
    assert all(isinstance(o, StaleState) for o in outcomes if o != 500)
    assert (await node_b.newest(s)).version == 500


async def test_a_registry_shares_the_client_of_a_started_tier(url) -> None:
    prefix = f"r{os.getpid()}x{next(_prefixes)}"
    async with RedisTier(RedisTierOptions(url, key_prefix=prefix), keyring=dev_keyring()) as tier:
        registry = RedisVersionRegistry(tier.client, key_prefix=prefix, ttl_seconds=60)
        s, sid = stream(), new_state_id()
        assert await registry.claim(s, sid) == 1
        assert 0 < await tier.client.ttl(f"{prefix}:v:{{{s.hex()}}}") <= 60
        assert 0 < await tier.client.ttl(f"{prefix}:s:{{{sid.hex()}}}") <= 60
        await registry.close()  # not its client: the tier's stays open
        assert await tier.client.ping()
