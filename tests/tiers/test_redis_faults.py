"""The Redis tier when Redis fails: killed, frozen, brought back.

A dead or frozen server turns every operation into ``Unavailable`` in bounded time (the
``wait_for`` bounds below only guard against a hang; they are not timing assertions), except
reading under a lease whose bytes already came with the manifest; the tier reports
``available = False``, and when a server answers again on the same port the same tier
instance serves again, without being recreated. A load whose chunks are on their way
over several connections when the server dies is ``Unavailable``, never part of an object.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import redis.asyncio.connection

from statetier.protocol.errors import NotFound, Unavailable
from statetier.protocol.identity import new_state_id
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.redis.registry import RedisVersionRegistry
from tests.support.redis_tier import KEYRING, make_object
from tests.support.tier_contract import load, store

HANG_GUARD_S = 60.0


async def unavailable(operation) -> Unavailable:
    """Await ``operation``; it must raise Unavailable (the bound only catches a hang)."""
    with pytest.raises(Unavailable) as caught:
        await asyncio.wait_for(operation, HANG_GUARD_S)
    return caught.value


@pytest.fixture
async def tier(fresh_redis):
    tier = RedisTier(RedisTierOptions(fresh_redis.url, capacity_bytes=64 << 20, socket_timeout=1.0, retries=2),
        keyring=KEYRING)
    await tier.start()
    yield tier
    await asyncio.wait_for(tier.close(), HANG_GUARD_S)


async def test_a_killed_server_makes_every_operation_unavailable_until_it_is_back(fresh_redis, tier) -> None:
    stored, blob = make_object(5 << 20)  # read() fetches its chunks
    small, small_blob = make_object(100_000, layer=3)  # under PREFETCH_BYTES: prepare_load fetched it
    await store(tier, stored, blob)
    await store(tier, small, small_blob)
    lease = await tier.prepare_load(stored.object_id)
    small_lease = await tier.prepare_load(small.object_id)
    fresh_redis.kill()

    meta, small = make_object(1000, layer=1)
    error = await unavailable(store(tier, meta, small))  # reserved here; the commit meets the dead server
    assert "redis unavailable" in str(error) and error.__cause__ is not None
    assert tier.stats().extra["reserved_bytes"] == 0
    await unavailable(tier.read(lease))
    assert bytes(await tier.read(small_lease)) == small_blob  # its lease holds its verified bytes
    await tier.complete_load(small_lease)
    await tier.complete_load(lease)
    await unavailable(tier.prepare_load(stored.object_id))
    await unavailable(tier.contains(stored.object_id))
    await unavailable(tier.get_meta(stored.object_id))
    await unavailable(tier.find_by_key(stored.key_digest))
    await unavailable(tier.delete(stored.object_id))
    await unavailable(tier.evict(1 << 20))
    await unavailable(_drain(tier.iter_objects()))
    stats = tier.stats()
    assert stats.extra["available"] is False and stats.extra["unavailable_total"] >= 9

    fresh_redis.restart()  # same port, empty (no persistence)
    with pytest.raises(NotFound):
        await tier.prepare_load(stored.object_id)
    assert tier.stats().extra["available"] is True
    meta, blob = make_object(3 << 20, layer=2)
    await store(tier, meta, blob)
    assert await load(tier, meta.object_id) == blob


async def test_a_store_cut_by_a_crash_leaves_nothing_visible_after_restart(fresh_redis, tier) -> None:
    meta, blob = make_object(5 << 20)
    ticket = await tier.prepare_store(meta)
    fresh_redis.kill()
    try:
        await unavailable(tier.write(ticket, [blob]))
    finally:
        await asyncio.wait_for(tier.complete_store(ticket, False), HANG_GUARD_S)  # best effort, no raise
    assert tier.stats().extra["reserved_bytes"] == 0

    fresh_redis.restart()
    assert not await tier.contains(meta.object_id)
    await store(tier, meta, blob)
    assert await load(tier, meta.object_id) == blob


async def test_objects_survive_a_restart_with_persistence_and_the_same_tier_reads_them(fresh_redis, tier) -> None:
    fresh_redis.stop()
    fresh_redis.start(fresh_redis.port, ["--appendonly", "yes", "--appendfsync", "always"])
    meta, blob = make_object(2_500_000)
    await store(tier, meta, blob)
    fresh_redis.kill()
    await unavailable(tier.prepare_load(meta.object_id))

    fresh_redis.restart()
    assert await load(tier, meta.object_id) == blob
    assert tier.stats().extra["available"] is True


async def test_a_frozen_server_times_out_as_unavailable_and_recovers(fresh_redis) -> None:
    tier = RedisTier(RedisTierOptions(fresh_redis.url, socket_timeout=0.5, retries=1), keyring=KEYRING)
    await tier.start()
    meta, blob = make_object(1000)
    os.kill(fresh_redis.pid, signal.SIGSTOP)
    try:
        error = await unavailable(tier.contains(meta.object_id))
        assert "Timeout" in str(error) or "timeout" in str(error)
    finally:
        os.kill(fresh_redis.pid, signal.SIGCONT)
    await store(tier, meta, blob)
    assert await load(tier, meta.object_id) == blob
    await tier.close()


async def test_the_registry_is_unavailable_while_redis_is_down_and_recovers(fresh_redis) -> None:
    registry = RedisVersionRegistry(fresh_redis.url, socket_timeout=1.0, retries=1)
    stream = os.urandom(16)
    assert await registry.claim(stream, new_state_id()) == 1
    fresh_redis.kill()
    await unavailable(registry.claim(stream, new_state_id()))
    await unavailable(registry.newest(stream))
    assert registry.is_available is False
    fresh_redis.restart()
    assert await registry.claim(stream, new_state_id()) == 1  # the restarted server kept nothing
    assert registry.is_available is True
    await registry.close()


async def test_start_against_a_dead_server_is_unavailable_not_a_hang(fresh_redis) -> None:
    fresh_redis.kill()
    tier = RedisTier(RedisTierOptions(fresh_redis.url, socket_timeout=1.0, retries=1), keyring=KEYRING)
    await unavailable(tier.start())
    assert tier.stats().extra["available"] is False
    await tier.close()
    fresh_redis.restart()
    await tier.start()  # the same instance can start once Redis is there
    assert tier.stats().extra["available"] is True
    await tier.close()


async def _drain(iterator) -> list:
    return [item async for item in iterator]


async def test_a_load_cut_midway_by_a_dying_server_is_unavailable_and_returns_nothing(fresh_redis, monkeypatch) -> None:
    # A killed server closes its sockets: the cut is seen at once, whatever the timeout. One of
    # 1 s let storing 96 MiB time out on a busy machine (a server starved of CPU reads slowly).
    tier = RedisTier(RedisTierOptions(fresh_redis.url, socket_timeout=20.0, retries=2), keyring=KEYRING)
    await tier.start()
    meta, blob = make_object(96 << 20)  # 48 chunks over 4 connections: more than the sockets buffer
    await store(tier, meta, blob)
    lease = await tier.prepare_load(meta.object_id)
    asked, sent = asyncio.Event(), []
    send = redis.asyncio.connection.AbstractConnection.send_packed_command

    async def counted(connection, *args, **kwargs):
        await send(connection, *args, **kwargs)
        sent.append(connection)
        if len(sent) == 4:
            asked.set()

    monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", counted)
    reading = asyncio.create_task(tier.read(lease))
    await asyncio.wait_for(asked.wait(), HANG_GUARD_S)  # every group asked for its chunks
    assert not reading.done()
    fresh_redis.kill()
    await unavailable(reading)
    assert tier.stats().extra["available"] is False
    await tier.complete_load(lease)
    assert tier.stats().leases == 0
    await asyncio.wait_for(tier.close(), HANG_GUARD_S)
