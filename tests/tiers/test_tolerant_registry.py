"""The version registry through a Redis outage (tiers/tolerant_registry.py; issue 35 item 1).

On a real redis-server that the tests kill and restart (with and without its data):

- reads during the outage answer what this process claimed or read (never an older version
  than one it saw); claims take versions above it (a stream's first ``OUTAGE_STRIDE`` ahead),
  wait as ``pending``, and ``reconcile`` writes them into Redis with their exact versions;
- a claim that was on its way when Redis froze, and ran when it woke, never beats the ones
  made meanwhile (the stride), even when its put was refused and withdrawn;
- a Redis restarted without its data gets the outage's heads back from ``reconcile``;
- a claim another registry beat meanwhile (a head as new or newer in Redis) is ``lost``;
- ``on_outage="refuse"``: claims are ``RegistryUnavailable``, reads still answer locally;
- while degraded, ``is_degraded`` says so; a registry of one process never is.
"""

from __future__ import annotations

import os

import pytest

from statetier.protocol.errors import RegistryUnavailable, StaleState
from statetier.protocol.identity import new_state_id
from statetier.tiers.registry import Claim, Claimed, MemoryVersionRegistry
from statetier.tiers.redis.registry import RedisVersionRegistry
from statetier.tiers.tolerant_registry import OUTAGE_STRIDE, TolerantRegistry


def tolerant(url: str, on_outage="local") -> TolerantRegistry:
    return TolerantRegistry(RedisVersionRegistry(url, socket_timeout=1.0, retries=1), on_outage=on_outage)


async def test_an_outage_is_answered_from_what_this_registry_saw_and_reconciled_after(fresh_redis) -> None:
    registry = tolerant(fresh_redis.url)
    stream, first, second = os.urandom(16), new_state_id(), new_state_id()
    assert await registry.claim(stream, first) == 1
    assert not registry.is_degraded
    fresh_redis.kill()

    head = await registry.newest(stream)
    assert head is not None and (head.version, head.state_id) == (1, first)
    assert registry.is_degraded
    (answer,) = await registry.claim_many([Claim(stream, second)])
    outage = 1 + OUTAGE_STRIDE  # a stream's first version in an outage: ahead of claims still on their way
    assert isinstance(answer, Claimed) and answer.version == outage
    assert list(registry.pending) == [second]
    assert await registry.stream_of(second) == stream
    heads, streams = await registry.read_many([stream], [first])
    assert heads[0] is not None and (heads[0].version, heads[0].state_id) == (outage, second)
    assert streams == [stream]
    assert await registry.claim(stream, new_state_id()) == outage + 1  # then one by one
    (stale,) = await registry.claim_many([Claim(stream, new_state_id(), version=outage)])
    assert isinstance(stale, StaleState)  # the outage keeps the rule: not newer than the newest known

    fresh_redis.start(fresh_redis.port)  # killed: what it held unsaved is gone
    assert await registry.reconcile() == 0
    assert (registry.reconciled, registry.lost, registry.pending) == (2, 0, {})
    assert not registry.is_degraded
    other = RedisVersionRegistry(fresh_redis.url)
    head = await other.newest(stream)
    assert head is not None and head.version == outage + 1
    assert await other.claim(stream, new_state_id()) == outage + 2
    await other.close()
    await registry.close()


async def test_a_redis_back_without_its_data_gets_the_outage_heads_back(fresh_redis) -> None:
    registry = tolerant(fresh_redis.url)
    stream = os.urandom(16)
    for version in (1, 2):
        assert await registry.claim(stream, new_state_id()) == version
    fresh_redis.kill()
    assert await registry.claim(stream, new_state_id()) == 2 + OUTAGE_STRIDE
    fresh_redis.close()
    fresh_redis.start(fresh_redis.port)  # a new dir: nothing kept
    assert await registry.reconcile() == 0
    other = RedisVersionRegistry(fresh_redis.url)
    head = await other.newest(stream)
    assert head is not None and head.version == 2 + OUTAGE_STRIDE
    await other.close()
    await registry.close()


async def test_a_claim_another_daemon_beat_during_the_outage_is_lost(fresh_redis) -> None:
    mine, theirs = tolerant(fresh_redis.url), RedisVersionRegistry(fresh_redis.url)
    stream = os.urandom(16)
    assert await mine.claim(stream, new_state_id()) == 1
    fresh_redis.kill()
    version = 1 + OUTAGE_STRIDE
    assert await mine.claim(stream, new_state_id()) == version  # local, pending
    fresh_redis.start(fresh_redis.port)
    winner = new_state_id()
    assert await theirs.claim(stream, winner, version=version) == version  # the other daemon, first in Redis
    assert await mine.reconcile() == 0
    assert (mine.reconciled, mine.lost) == (0, 1)
    head = await mine.newest(stream)
    assert head is not None and (head.version, head.state_id) == (version, winner)
    await theirs.close()
    await mine.close()


async def test_refuse_makes_outage_claims_registry_unavailable_and_reads_still_answer(fresh_redis) -> None:
    registry = tolerant(fresh_redis.url, on_outage="refuse")
    stream, state = os.urandom(16), new_state_id()
    assert await registry.claim(stream, state) == 1
    fresh_redis.kill()
    with pytest.raises(RegistryUnavailable, match='on_outage = "refuse"'):
        await registry.claim(stream, new_state_id())
    assert registry.pending == {}
    head = await registry.newest(stream)
    assert head is not None and head.state_id == state
    assert registry.is_degraded and not MemoryVersionRegistry().is_degraded
    await registry.close()


async def test_a_withdrawn_outage_claim_is_never_written_back(fresh_redis) -> None:
    registry = tolerant(fresh_redis.url)
    stream = os.urandom(16)
    assert await registry.claim(stream, new_state_id()) == 1
    fresh_redis.kill()
    claim = Claim(stream, new_state_id())
    (answer,) = await registry.claim_many([claim])
    assert isinstance(answer, Claimed)
    await registry.withdraw([(claim, answer)])
    assert registry.pending == {}
    head = await registry.newest(stream)
    assert head is not None and head.version == 1
    fresh_redis.start(fresh_redis.port)
    assert await registry.reconcile() == 0 and registry.reconciled == 0
    await registry.close()


async def test_a_claim_that_ran_late_on_a_frozen_server_never_beats_the_outage_claims(fresh_redis) -> None:
    import signal

    registry = TolerantRegistry(RedisVersionRegistry(fresh_redis.url, socket_timeout=0.5, retries=0))
    stream = os.urandom(16)
    assert await registry.claim(stream, new_state_id()) == 1
    os.kill(fresh_redis.pid, signal.SIGSTOP)
    try:
        ghost = Claim(stream, new_state_id())
        (answer,) = await registry.claim_many([ghost])  # times out; made here; the server has it queued
        assert isinstance(answer, Claimed) and answer.version == 1 + OUTAGE_STRIDE
        await registry.withdraw([(ghost, answer)])  # its put failed: withdrawn here, not in Redis
        kept = new_state_id()
        assert await registry.claim(stream, kept) == 1 + OUTAGE_STRIDE
    finally:
        os.kill(fresh_redis.pid, signal.SIGCONT)
    other = RedisVersionRegistry(fresh_redis.url)
    late = await other.newest(stream)
    assert late is not None and late.version == 2  # the queued claim ran when the server woke
    assert await registry.reconcile() == 0 and (registry.reconciled, registry.lost) == (1, 0)
    head = await other.newest(stream)
    assert head is not None and (head.version, head.state_id) == (1 + OUTAGE_STRIDE, kept)
    await other.close()
    await registry.close()
