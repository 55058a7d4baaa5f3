"""Every Redis call under one deadline, and the health probe that spares calls an outage
(issue 35 items 2–4).

- A frozen server (SIGSTOP) costs a tier call and a registry call at most the configured
  deadline (``socket_timeout``), every retry included: with retries=3 and a 1 s deadline the
  old per-attempt timeouts cost four seconds and more; the call is done well before that
  (a bounded wait, not a timing assertion: ``eventually`` with a limit between the two).
- While ``probe()`` finds the server down, calls fail at once without a round trip (counted
  in ``refused_while_down``); the probe that finds it back lets them through again, on the
  same tier instance. The tier and a registry that share its edge are both spared.
- A tier started with ``start_unreachable="degraded"`` against a port nothing listens on
  starts, answers ``Unavailable``, and serves once a server answers there and a probe ran.
- A delaying proxy between tier and server: chunks late by less than the deadline are served
  (the exact bytes); held past it, the call is ``Unavailable`` within its deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from statetier.launch.processes import free_port
from statetier.launch.redis_servers import RedisServer
from statetier.launch.tcp_proxy import DelayProxy
from statetier.protocol.errors import Unavailable
from statetier.protocol.identity import new_state_id
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.redis.registry import RedisVersionRegistry
from tests.support.redis_tier import KEYRING, make_object
from tests.support.tier_contract import load, store
from tests.support.waiting import eventually

DEADLINE_S = 1.0
RETRIES = 3
# Old behaviour: (RETRIES + 1) attempts of DEADLINE_S each. A bound between one deadline and that.
WITHIN_S = (RETRIES + 1) * DEADLINE_S - 0.5


async def finishes_unavailable(call) -> Unavailable:
    task = asyncio.ensure_future(call)
    try:
        await eventually(task.done, "the call to end", timeout=WITHIN_S)
    finally:
        if not task.done():
            task.cancel()
    with pytest.raises(Unavailable) as caught:
        task.result()
    return caught.value


@pytest.fixture
async def tier(fresh_redis):
    tier = RedisTier(RedisTierOptions(fresh_redis.url, socket_timeout=DEADLINE_S, retries=RETRIES), keyring=KEYRING)
    await tier.start()
    yield tier
    os.kill(fresh_redis.pid, signal.SIGCONT)
    await tier.close()


async def test_a_frozen_server_costs_a_tier_call_one_deadline_retries_included(fresh_redis, tier) -> None:
    meta, blob = make_object(1000)
    os.kill(fresh_redis.pid, signal.SIGSTOP)
    error = await finishes_unavailable(tier.contains(meta.object_id))
    assert "deadline of 1 s" in str(error)
    await finishes_unavailable(store(tier, meta, blob))
    os.kill(fresh_redis.pid, signal.SIGCONT)
    await store(tier, meta, blob)
    assert await load(tier, meta.object_id) == blob


async def test_a_frozen_server_costs_a_registry_claim_one_deadline(fresh_redis, tier) -> None:
    registry = RedisVersionRegistry(fresh_redis.url, socket_timeout=DEADLINE_S, retries=RETRIES)
    stream = os.urandom(16)
    assert await registry.claim(stream, new_state_id()) == 1
    os.kill(fresh_redis.pid, signal.SIGSTOP)
    await finishes_unavailable(registry.claim(stream, new_state_id()))
    await finishes_unavailable(registry.newest_many([stream]))
    os.kill(fresh_redis.pid, signal.SIGCONT)
    head = await registry.newest(stream)  # the timed-out claim reached the frozen server: it ran on SIGCONT
    assert head is not None and head.version == 2
    assert await registry.claim(stream, new_state_id()) == 3
    await registry.close()


async def test_while_the_probe_finds_redis_down_calls_fail_at_once_for_tier_and_registry(fresh_redis, tier) -> None:
    registry = RedisVersionRegistry(fresh_redis.url, socket_timeout=DEADLINE_S, edge=tier.edge)
    stream = os.urandom(16)
    assert await registry.claim(stream, new_state_id()) == 1
    meta, blob = make_object(1000)
    os.kill(fresh_redis.pid, signal.SIGSTOP)
    assert await tier.probe() is False
    assert tier.stats().extra["available"] is False
    for call in (tier.contains(meta.object_id), tier.prepare_load(meta.object_id), registry.newest(stream),
                 registry.claim(stream, new_state_id())):
        with pytest.raises(Unavailable, match="the health probe found it down"):
            await call
    assert tier.stats().extra["refused_while_down"] == 4
    os.kill(fresh_redis.pid, signal.SIGCONT)
    await eventually(tier.probe, "the probe to find redis back")
    assert tier.stats().extra["available"] is True
    await store(tier, meta, blob)
    assert await load(tier, meta.object_id) == blob
    assert await registry.claim(stream, new_state_id()) == 2
    await registry.close()


async def test_a_tier_started_degraded_serves_once_redis_answers_and_a_probe_ran() -> None:
    port = free_port()
    tier = RedisTier(RedisTierOptions(f"redis://127.0.0.1:{port}/0", socket_timeout=DEADLINE_S,
                                      start_unreachable="degraded"), keyring=KEYRING)
    await tier.start()
    meta, blob = make_object(1000)
    try:
        with pytest.raises(Unavailable):
            await tier.contains(meta.object_id)
        assert await tier.probe() is False
        with RedisServer().start(port):
            await eventually(tier.probe, "the probe to connect")
            await store(tier, meta, blob)
            assert await load(tier, meta.object_id) == blob
    finally:
        await tier.close()


async def test_a_tier_started_without_redis_refuses_by_default() -> None:
    tier = RedisTier(RedisTierOptions(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=DEADLINE_S),
                     keyring=KEYRING)
    with pytest.raises(Unavailable):
        await tier.start()
    await tier.close()


async def test_through_a_delaying_proxy_slow_is_served_and_held_is_unavailable_in_time(fresh_redis) -> None:
    with DelayProxy(fresh_redis.port, delay=0.05) as proxy:
        tier = RedisTier(RedisTierOptions(proxy.url, socket_timeout=DEADLINE_S, retries=RETRIES), keyring=KEYRING)
        await tier.start()
        try:
            meta, blob = make_object(300_000)
            await store(tier, meta, blob)
            assert await load(tier, meta.object_id) == blob
            proxy.hold()
            await finishes_unavailable(tier.contains(meta.object_id))
            proxy.release()
            assert await load(tier, meta.object_id) == blob
            assert proxy.connections >= 1
        finally:
            proxy.release()
            await tier.close()
