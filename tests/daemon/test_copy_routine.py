"""Issue 42, item 5: every tier-to-tier copy goes through one routine, ``Placement.begin_copy``.

A story over a real host arena above a real disk tier (written behind) and a real Redis
(published to): a batch of published puts, the write-behind worker's copies, an eviction's
demotions and a load's promotion. ``Placement.copy_calls`` counts the routine's calls by
(charge, source, target); after each step the count moved by exactly the copies that step
made, and every object that reached the disk or Redis tier got there through one call.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

from statetier.daemon.engine import Engine, EngineOptions, Publishing
from statetier.daemon.requests import Incoming, LoadRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, prefix_hashes
from statetier.protocol.keyring import Keyring
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.redis import RedisTier, RedisTierOptions
from statetier.tiers.registry import MemoryVersionRegistry
from tests.support.redis_tier import erase_prefix

SPECS = (TensorSpec("ssm", "float32", (64, 60)),)  # 15 KiB of payload: one 16 KiB extent with its header
OBJECT_EXTENT = 16 * 1024
CHAIN = prefix_hashes(list(range(64)), 16)
NS = NamespaceSpec("copy-routine", tenant="alice").namespace()


def data(layer: int) -> bytes:
    return bytes((layer * 7 + i) % 251 for i in range(SPECS[0].nbytes))


def item(layer: int, publish: bool = False) -> Incoming:
    key = StateKey(NS, Kind.SSM, layer, CHAIN[3], 0, 64)
    req = PutRequest("alice", key, Provenance(f"alice-{layer}", 3), SPECS, publish=publish)
    return Incoming(req, memoryview(data(layer)))


class Calls:
    """The routine's calls since the last step."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.seen: Counter = Counter()

    def step(self) -> dict:
        now = Counter(self.engine.placement.copy_calls)
        moved = now - self.seen
        self.seen = now
        return dict(moved)


async def drain_write_behind(engine: Engine) -> None:
    worker = asyncio.create_task(engine.placement.run_write_behind())
    try:
        assert await engine.placement.flush_write_behind(10)
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)


async def test_promotion_demotion_write_behind_and_batches_each_copy_once_through_the_routine(tmp_path, redis_server):
    keyring, prefix = Keyring.generate(), f"copies-{uuid.uuid4().hex[:10]}"
    host = HostTier(HostTierOptions(4 * OBJECT_EXTENT, pin_memory=False, high_watermark=1.0, low_watermark=0.5))
    disk = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=1 << 20), keyring=keyring)
    cross = RedisTier(RedisTierOptions(redis_server.url, key_prefix=prefix), keyring=keyring)
    engine = Engine([host, disk, cross], keyring=keyring, registry=MemoryVersionRegistry(),
                    options=EngineOptions(producer_id="copies"), arena=host, publishing=Publishing(cross, cross, marks=cross), write_behind_to=disk)
    for tier in (host, disk, cross):  # the engine's write-behind worker is run by hand, step by step
        await tier.start()
    calls = Calls(engine)
    try:
        published = await engine.put_batch([item(0, publish=True), item(1, publish=True)])
        assert [p.published for p in published] == [True, True]
        assert calls.step() == {("copy", "host", "redis"): 2}  # the batch's publish copies, from the arena

        await drain_write_behind(engine)
        assert calls.step() == {("copy", "host", "disk"): 2}  # written behind, published ones too

        refs = [p.ref for p in published]
        for layer in (2, 3, 4):  # the fifth object evicts to the low watermark: the LRU ones go
            (put,) = await engine.put_batch([item(layer)])
            refs.append(put.ref)
        assert calls.step() == {("demotion", "host", "disk"): 1}  # layers 0 and 1 were on disk already
        assert [layer for layer, r in enumerate(refs) if await host.contains(r.state_id)] == [3, 4]
        await drain_write_behind(engine)  # layers 3 and 4 (layer 2 was demoted before its turn)
        assert calls.step() == {("copy", "host", "disk"): 2}

        ref = published[1].ref  # on disk and in Redis only: a load promotes it into free room
        loaded = await engine.load(LoadRequest("alice", NS, ref=ref), owner="c")
        assert loaded.tier == "host" and bytes(loaded.payload) == data(1)
        await engine.release(loaded.lease_id, "c")
        assert calls.step() == {("promotion", "disk", "host"): 1}

        copies = engine.placement.copy_calls
        assert disk.stats().objects == sum(n for (_, _, target), n in copies.items() if target == "disk") == 5
        assert sum(n for (_, _, target), n in copies.items() if target == "redis") == 2
    finally:
        await engine.close()
        erase_prefix(redis_server.url, prefix)
