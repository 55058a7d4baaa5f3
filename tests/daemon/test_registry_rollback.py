"""A version registry rolled back under a daemon that has seen the newer version.

Someone with write access to Redis but no key cannot forge an object, but can replay an old
stream head (``st:v:{stream}``: version 1, the first state id) after version 2 was put. A
daemon that read version 2's head before keeps it: a load of version 1's ref is refused as
``stale``, version 2 is still served, the head found behind is counted
(``registry_heads_behind``), and the next put of the stream claims version 3 — not a second
version 2 — which writes the head forward again. Real Redis, real engine.

The same holds for batches: a batch's loads by ref read every head in one call and expect
the remembered versions; a batch's puts claim past them in one call (``Claim.past``), on a
Redis registry rolled back and on a local one that forgot the heads. A put refused after
its claim (over quota) gives back the version it made remembered with the claim.
"""

from __future__ import annotations

import pytest

from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.requests import Incoming, LoadRequest
from statetier.protocol.errors import QuotaExceeded, StaleState
from statetier.protocol.keyring import Keyring
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.redis import RedisVersionRegistry
from statetier.tiers.redis.layout import RedisKeys
from statetier.tiers.registry import MemoryVersionRegistry
from tests.support.engine_objects import NS, SPECS, payload_for, ssm_put

assert SPECS  # the engine's objects are test_engine's


@pytest.fixture
async def engine(fresh_redis):
    host = HostTier(HostTierOptions(1 << 20, granularity=4096))
    engine = Engine([host], keyring=Keyring.generate(), registry=RedisVersionRegistry(fresh_redis.url),
                    options=EngineOptions(producer_id="test"), arena=host)
    await engine.start()
    yield engine
    await engine.close()


async def load_bytes(engine: Engine, ref) -> bytes:
    result = await engine.load(LoadRequest("default", NS, ref=ref), owner="c1")
    try:
        return bytes(result.payload)
    finally:
        await engine.release(result.lease_id, "c1")


async def test_a_rolled_back_head_is_caught_by_a_daemon_that_saw_the_newer_version(engine, fresh_redis):
    first = (await engine.put(*ssm_put(seed=1))).ref
    second = (await engine.put(*ssm_put(seed=2))).ref
    assert (first.version, second.version) == (1, 2)
    assert await load_bytes(engine, second) == payload_for(2)  # the head (version 2) read here

    head = RedisKeys("st").stream_head(second.stream_id)
    with fresh_redis.client() as redis:  # the replay: version 1's head again
        redis.hset(head, mapping={"version": "1", "state_id": first.state_id})

    with pytest.raises(StaleState):
        await load_bytes(engine, first)
    assert await load_bytes(engine, second) == payload_for(2)
    assert engine.stats()["registry_heads_behind"] == 2

    third = (await engine.put(*ssm_put(seed=3))).ref
    assert third.version == 3
    with fresh_redis.client() as redis:
        assert redis.hget(head, "version") == b"3"


# -- the same rule for batches (issue 21's claim_many / read_many) -------------------------


class CountedRedisRegistry(RedisVersionRegistry):
    """The real Redis registry, counting the calls that claim versions (by name)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.claim_calls: list[str] = []

    async def claim(self, *args, **kwargs):
        self.claim_calls.append("claim")
        return await super().claim(*args, **kwargs)

    async def claim_many(self, claims):
        self.claim_calls.append("claim_many")
        return await super().claim_many(claims)


def ssm_batch(seed: int, layers=range(4)) -> list[Incoming]:
    """One SSM snapshot per layer (one stream each), all of request req-1 at boundary 3."""
    return [Incoming(req, memoryview(data)) for req, data in (ssm_put(layer=layer, seed=seed + layer)
                                                              for layer in layers)]


async def load_batch_bytes(engine: Engine, refs) -> list[bytes]:
    results = await engine.load_batch([LoadRequest("default", NS, ref=ref) for ref in refs], owner="c1")
    try:
        return [bytes(result.payload) for result in results]
    finally:
        await engine.release_many([result.lease_id for result in results], "c1")


async def test_a_rolled_back_batch_is_fenced_and_the_next_batch_claims_past_it_in_one_call(fresh_redis):
    host = HostTier(HostTierOptions(1 << 20, granularity=4096))
    registry = CountedRedisRegistry(fresh_redis.url)
    engine = Engine([host], keyring=Keyring.generate(), registry=registry,
                    options=EngineOptions(producer_id="test"), arena=host)
    await engine.start()
    try:
        first = [r.ref for r in await engine.put_batch(ssm_batch(10))]
        second = [r.ref for r in await engine.put_batch(ssm_batch(20))]
        assert [r.version for r in first + second] == [1] * 4 + [2] * 4
        assert await load_batch_bytes(engine, second) == [payload_for(20 + n) for n in range(4)]

        with fresh_redis.client() as redis:  # every head of the batch replayed to version 1
            for old in first:
                redis.hset(RedisKeys("st").stream_head(old.stream_id),
                           mapping={"version": "1", "state_id": old.state_id})

        for old in first:  # each old ref alone: a batch stops at its first refusal
            (refused,) = await engine.load_batch([LoadRequest("default", NS, ref=old)], owner="c1")
            assert isinstance(refused, StaleState)
        assert await load_batch_bytes(engine, second) == [payload_for(20 + n) for n in range(4)]
        assert engine.stats()["registry_heads_behind"] == 8  # 4 old loads + 4 new ones found the heads behind

        registry.claim_calls.clear()
        third = [r.ref for r in await engine.put_batch(ssm_batch(30))]
        assert [r.version for r in third] == [3] * 4  # past the versions seen here, not a second 2
        assert registry.claim_calls == ["claim_many"]  # still one registry call for the batch
        assert engine.stats()["registry_heads_behind"] == 12
        with fresh_redis.client() as redis:
            assert [redis.hget(RedisKeys("st").stream_head(r.stream_id), "version") for r in third] == [b"3"] * 4
        assert await load_batch_bytes(engine, third) == [payload_for(30 + n) for n in range(4)]
    finally:
        await engine.close()


async def test_a_local_registry_that_forgot_a_batchs_heads_is_fenced_by_what_the_daemon_saw():
    # the in-memory registry keeps max_streams heads: four other streams push a batch's out
    host = HostTier(HostTierOptions(1 << 20, granularity=4096))
    engine = Engine([host], keyring=Keyring.generate(), registry=MemoryVersionRegistry(max_streams=4),
                    options=EngineOptions(producer_id="test"), arena=host)
    await engine.start()
    try:
        first = [r.ref for r in await engine.put_batch(ssm_batch(10, range(2)))]
        second = [r.ref for r in await engine.put_batch(ssm_batch(20, range(2)))]
        await engine.put_batch(ssm_batch(40, range(2, 6)))
        assert [await engine.registry.newest(r.stream_id) for r in second] == [None, None]  # forgotten

        (refused,) = await engine.load_batch([LoadRequest("default", NS, ref=first[0])], owner="c1")
        assert isinstance(refused, StaleState)
        assert await load_batch_bytes(engine, second) == [payload_for(20), payload_for(21)]
        third = [r.ref for r in await engine.put_batch(ssm_batch(30, range(2)))]
        assert [r.version for r in third] == [3, 3]
    finally:
        await engine.close()


async def test_a_put_refused_after_its_claim_leaves_the_newest_version_loadable(fresh_redis):
    # the quota refuses the second put after its version was claimed: the claim is withdrawn,
    # and so is the version it made this daemon remember (else version 1 would load as stale)
    one_object = 20 * 1024
    host = HostTier(HostTierOptions(1 << 20, granularity=4096))
    engine = Engine([host], keyring=Keyring.generate(), registry=RedisVersionRegistry(fresh_redis.url),
                    options=EngineOptions(producer_id="test", quotas={"default": {"host": one_object}}), arena=host)
    await engine.start()
    try:
        first = (await engine.put(*ssm_put(seed=1))).ref
        with pytest.raises(QuotaExceeded):
            await engine.put(*ssm_put(seed=2))
        assert (await engine.registry.newest(first.stream_id)).version == 1
        assert await load_bytes(engine, first) == payload_for(1)
        assert engine.stats()["registry_heads_behind"] == 0
    finally:
        await engine.close()
