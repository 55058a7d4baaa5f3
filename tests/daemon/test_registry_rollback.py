"""A version registry rolled back under a daemon that has seen the newer version.

Someone with write access to Redis but no key cannot forge an object, but can replay an old
stream head (``st:v:{stream}``: version 1, the first state id) after version 2 was put. A
daemon that read version 2's head before keeps it: a load of version 1's ref is refused as
``stale``, version 2 is still served, the head found behind is counted
(``registry_heads_behind``), and the next put of the stream claims version 3 — not a second
version 2 — which writes the head forward again. Real Redis, real engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling test_engine.py
from test_engine import NS, SPECS, payload_for, ssm_put  # noqa: E402

from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.requests import LoadRequest
from statetier.protocol.errors import StaleState
from statetier.protocol.keyring import Keyring
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.redis import RedisVersionRegistry
from statetier.tiers.redis.layout import RedisKeys

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
