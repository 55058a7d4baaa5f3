"""The Redis version registry: one ordering of versions for every node, on one server or a cluster.

Two registries on two separate clients stand for two nodes. They must agree on the newest
version of a stream, never hand out one version twice however their claims interleave,
refuse a version that is not newer (naming the newest), and remember which stream each
state_id was claimed for. A batch's claims go in one round trip, in order per stream; a
stale one ends the batch (what followed it is withdrawn), and a withdrawal restores the
previous head only while the withdrawn claim is still the head. A claim without a version
goes past the version its claimer saw (``Claim.past``) when the head is behind it or gone,
here and in the in-memory registry alike.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest
import redis.asyncio.connection
from redis.asyncio import RedisCluster

from statetier.protocol.errors import InvalidRequest, StaleState
from statetier.protocol.identity import new_state_id
from statetier.protocol.keyring import dev_keyring
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.redis.registry import RedisVersionRegistry
from statetier.tiers.registry import Claim, MemoryVersionRegistry, StreamHead

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


# -- a batch's claims in one call (issue 21) ------------------------------------------------


async def test_a_batch_of_claims_is_one_round_trip_in_order_per_stream(url, monkeypatch) -> None:
    prefix = f"r{os.getpid()}x{next(_prefixes)}"
    registry = RedisVersionRegistry(url, key_prefix=prefix)
    try:
        await registry.newest(stream())  # connected, scripts registered
        sends = []
        send = redis.asyncio.connection.AbstractConnection.send_packed_command

        async def counted(connection, *args, **kwargs):
            sends.append(connection)
            return await send(connection, *args, **kwargs)

        monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", counted)
        shared, others = stream(), [stream() for _ in range(62)]
        claims = [Claim(shared, new_state_id()), *(Claim(s, new_state_id()) for s in others),
                  Claim(shared, new_state_id())]
        answers = await registry.claim_many(claims)
        assert [a.version for a in answers] == [1] + [1] * 62 + [2]  # one stream's claims in their order
        assert answers[0].previous is None and answers[-1].previous == StreamHead(1, claims[0].state_id)
        if not isinstance(registry._client, RedisCluster):  # (a cluster: one pipeline, sent per master)
            assert len(sends) == 1  # 64 claims and their state_id records: one round trip
        assert await registry.newest(shared) == StreamHead(2, claims[-1].state_id)
        assert await registry.stream_of(claims[5].state_id) == others[4]
    finally:
        await registry.close()


async def test_a_stale_claim_ends_the_batch_and_what_follows_it_is_withdrawn(two_nodes) -> None:
    node_a, node_b = two_nodes
    streams = [stream() for _ in range(3)]
    await node_a.claim_many([Claim(s, new_state_id()) for s in streams])
    batch = [Claim(streams[0], new_state_id(), 5), Claim(streams[1], new_state_id(), 1),
             Claim(streams[2], new_state_id(), 5)]
    answers = await node_b.claim_many(batch)
    assert answers[0].version == 5 and isinstance(answers[1], StaleState) and answers[2] is None
    assert (await node_a.newest(streams[2])).version == 1  # the third claim was made, then withdrawn

    await node_a.withdraw([(batch[0], answers[0])])  # a stored-nothing batch gives its claim back
    assert (await node_b.newest(streams[0])).version == 1
    late = Claim(streams[0], new_state_id())
    taken = await node_b.claim_many([late])
    await node_a.withdraw([(batch[0], answers[0])])  # no longer the head: left alone
    assert await node_b.newest(streams[0]) == StreamHead(taken[0].version, late.state_id)
    fresh = Claim(stream(), new_state_id())
    (claimed,) = await node_a.claim_many([fresh])
    await node_a.withdraw([(fresh, claimed)])
    assert await node_b.newest(fresh.stream_id) is None  # a new stream withdrawn is no stream


# -- a claim past the version its claimer saw (a head rolled back or lost) ----------------


@pytest.fixture(params=["memory", "single", "cluster"])
async def any_registry(request):
    if request.param == "memory":
        yield MemoryVersionRegistry()
        return
    url = request.getfixturevalue("redis_server" if request.param == "single" else "redis_cluster").url
    registry = RedisVersionRegistry(url, key_prefix=f"r{os.getpid()}x{next(_prefixes)}")
    yield registry
    await registry.close()


async def test_a_claim_without_a_version_goes_past_what_its_claimer_saw_whatever_the_head(any_registry) -> None:
    registry = any_registry
    behind, lost, ahead = stream(), stream(), stream()
    await registry.claim_many([Claim(behind, new_state_id()), Claim(ahead, new_state_id(), 9)])
    claims = [Claim(behind, new_state_id(), past=7),  # the head (1) is behind what was seen: 8
              Claim(lost, new_state_id(), past=7),  # no head at all (expired, forgotten): 8
              Claim(ahead, new_state_id(), past=7),  # the head (9) is ahead: simply the next, 10
              Claim(behind, new_state_id(), past=7),  # the batch's own claim is the head now: 9
              Claim(behind, new_state_id(), 20, past=30)]  # a given version is taken as given
    answers = await registry.claim_many(claims)
    assert [a.version for a in answers] == [8, 8, 10, 9, 20]
    assert [a.previous and a.previous.version for a in answers] == [1, None, 9, 8, 9]
    assert await registry.newest(behind) == StreamHead(20, claims[-1].state_id)

    await registry.withdraw([(claims[0], answers[0])])  # not the head any more: left alone
    assert (await registry.newest(behind)).version == 20
    await registry.withdraw([(claims[1], answers[1])])
    assert await registry.newest(lost) is None
