"""Fixtures the tier tests share (the contract suite's own are in ``tests/support/tier_contract.py``).

- ``started`` — ``await started(tier)`` starts ``tier`` and returns it; every tier started
  so is closed after the test, in order (a test may close and reopen one itself: ``close``
  twice is harmless).
- ``open_disk`` — ``await open_disk(**options)`` → a started ``DiskTier`` in
  ``tmp_path / "disk"`` (64 KiB segments, ``capacity`` 64 MiB unless given, the
  ``disk_crash_writer.KEYRING``); the same directory each call, so a second call reopens.
- ``backend`` — parametrized: the session's Redis server, then its Redis Cluster, as a
  ``Backend`` (``tests/support/redis_tier.py``).
- ``make_tier`` — ``await make_tier(url, **options)`` → a started ``RedisTier`` under a
  key prefix of its own (the servers are shared), closed after the test.
"""

from __future__ import annotations

import uuid

import pytest

from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.redis import RedisTier, RedisTierOptions
from tests.support import disk_crash_writer, redis_tier


@pytest.fixture
async def started():
    opened = []

    async def start(tier):
        await tier.start()
        opened.append(tier)
        return tier

    yield start
    for tier in opened:
        await tier.close()


@pytest.fixture
def open_disk(tmp_path, started):
    def open_(**options):
        options.setdefault("segment_bytes", 64 * 1024)
        runtime = {name: options.pop(name) for name in ("cipher", "executor") if name in options}
        capacity = options.pop("capacity", 64 << 20)
        return started(DiskTier(DiskTierOptions(tmp_path / "disk", capacity, **options),
                                keyring=disk_crash_writer.KEYRING, **runtime))

    return open_


@pytest.fixture(params=["single", "cluster"])
def backend(request):
    if request.param == "single":
        found = redis_tier.Backend(request.getfixturevalue("redis_server").url, False)
    else:
        found = redis_tier.Backend(request.getfixturevalue("redis_cluster").url, True)
    yield found
    found.raw.close()


@pytest.fixture
def make_tier(started):
    def make(url: str, **options):
        options.setdefault("key_prefix", f"rt-{uuid.uuid4().hex[:16]}")
        runtime = {name: options.pop(name) for name in ("keyring", "cipher", "executor") if name in options}
        runtime.setdefault("keyring", redis_tier.KEYRING)
        return started(RedisTier(RedisTierOptions(url, **options), **runtime))

    return make
