"""A load batch across two daemons: one request per owner, each byte received once (issue 40).

Two engines in one process as the composition root wires them (host arena, disk tier, peer
tier on a real redis-server; the peer tier pulls a batch's copies, ``batch_pulls``): prefill
publishes a batch, decode loads it by ref in one ``load_batch``.

- the batch's objects are pulled with one request to their owner (``PULL_MANY``), each
  received straight into its promotion's reservation in decode's arena and served from
  there: no copy and no hash of a payload byte in either engine (the socket moved them once;
  the client copies and verifies where they land), counted with ``protocol.passes``;
- a load of the batch whose object its owner no longer holds is a miss for that load alone
  (``NotFound``), never bytes of another; a batch whose owner is gone misses loudly too;
- what a batch left unclaimed (a load before it failed) gives its arena room and leases back;
- prefill's disk copies of what it published are written behind, after the pulls it answers.
"""

from __future__ import annotations

import contextlib
import os

from statetier.daemon.engine import Engine, EngineOptions
from statetier.daemon.requests import Incoming, LoadRequest, PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import NotFound, StatetierError
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import Keyring
from statetier.protocol.passes import PASSES
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.peer import PeerTier, PeerTierOptions
from statetier.tiers.registry import MemoryVersionRegistry

NS = NamespaceSpec("peer-batches").namespace()
SPECS = (TensorSpec("k", "bfloat16", (4, 8, 16, 128)),)  # 128 KiB
PAYLOAD = 4 * 8 * 16 * 128 * 2
OBJECTS = 12


@contextlib.asynccontextmanager
async def node(url: str, name: str, keyring: Keyring, registry, folder):
    host = HostTier(HostTierOptions(32 << 20, pin_memory=False))
    disk = DiskTier(DiskTierOptions(folder / name, 256 << 20, segment_bytes=4 << 20), keyring=keyring)

    async def holds_locally(object_id: bytes) -> bool:
        return await host.contains(object_id) or await disk.contains(object_id)

    peer = PeerTier(PeerTierOptions(url, owner_id=name, pull_timeout=2.0), keyring=keyring, local_tiers=[host, disk],
                    holds_locally=holds_locally)
    engine = Engine([host, disk, peer], keyring=keyring, registry=registry, arena=host, publish=peer,
                    write_behind_to=disk, options=EngineOptions(producer_id=name), batch_pulls=peer,
                    write_behind_yields_to=peer.server.quiet)
    await engine.start()
    try:
        yield engine, host, disk, peer
    finally:
        await engine.close()


async def publish(engine: Engine, count: int = OBJECTS) -> tuple[list, list[bytes]]:
    payloads = [os.urandom(PAYLOAD) for _ in range(count)]
    items = [Incoming(PutRequest("default", StateKey(NS, Kind.KV, layer, os.urandom(32), 0, 16), Provenance("r"),
                                 SPECS, publish=True), memoryview(data)) for layer, data in enumerate(payloads)]
    puts = await engine.put_batch(items)
    assert all(not isinstance(put, StatetierError) and put.published for put in puts)
    return [put.ref for put in puts], payloads


def loads(refs) -> list[LoadRequest]:
    return [LoadRequest("default", NS, ref=ref) for ref in refs]


async def test_a_batch_is_one_pull_per_owner_landed_in_the_arena_with_no_copy(fresh_redis, tmp_path):
    keyring, registry = Keyring.generate(), MemoryVersionRegistry()
    async with node(fresh_redis.url, "prefill", keyring, registry, tmp_path) as (prefill, _, _, owner), \
            node(fresh_redis.url, "decode", keyring, registry, tmp_path) as (decode, host, _, puller):
        refs, payloads = await publish(prefill)
        before = PASSES.snapshot()
        results = await decode.load_batch(loads(refs), "c")
        after = PASSES.snapshot()
        try:
            assert [bytes(r.payload) for r in results] == payloads and {r.tier for r in results} == {"host"}
            assert (after.copied - before.copied, after.hashed - before.hashed) == (0, 0)  # received once, no copy
            assert owner.server.batches == 1 and owner.server.served == OBJECTS  # one request for the batch
            assert all([await host.contains(ref.state_id) for ref in refs])  # each landed in its reservation
        finally:
            await decode.release_many([r.lease_id for r in results], "c")
        again = await decode.load_batch(loads(refs), "c")
        assert {r.tier for r in again} == {"host"} and owner.server.served == OBJECTS  # nothing pulled twice
        await decode.release_many([r.lease_id for r in again], "c")
        assert decode.lease_count == 0 and puller.stats().leases == 0


async def test_an_object_its_owner_no_longer_holds_misses_alone(fresh_redis, tmp_path):
    keyring, registry = Keyring.generate(), MemoryVersionRegistry()
    async with node(fresh_redis.url, "prefill", keyring, registry, tmp_path) as (prefill, p_host, p_disk, owner), \
            node(fresh_redis.url, "decode", keyring, registry, tmp_path) as (decode, host, _, _):
        refs, payloads = await publish(prefill, 4)
        await prefill.placement.flush_write_behind(10)
        for tier in (p_host, p_disk):
            await tier.delete(refs[1].state_id)  # gone from its owner, still described
        results = await decode.load_batch(loads(refs), "c")
        assert owner.server.batches == 1
        assert bytes(results[0].payload) == payloads[0] and isinstance(results[1], NotFound)
        assert results[2:] == [None, None]  # a batch stops at its first failure
        await decode.release_many([results[0].lease_id], "c")
        assert decode.lease_count == 0
        assert not await host.contains(refs[2].state_id)  # pulled for nothing: its room given back
        assert host.stats().bytes_used == (await host.get_meta(refs[0].state_id)).size


async def test_published_objects_are_written_to_the_owners_disk_behind_the_answer(fresh_redis, tmp_path):
    keyring, registry = Keyring.generate(), MemoryVersionRegistry()
    async with node(fresh_redis.url, "prefill", keyring, registry, tmp_path) as (prefill, _, disk, _):
        refs, _ = await publish(prefill, 4)
        await prefill.placement.flush_write_behind(10)
        assert all([await disk.contains(ref.state_id) for ref in refs])
