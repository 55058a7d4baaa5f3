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
- a publish is answered once in memory and described (``durable: false``), its disk copy
  written behind and only once the pull prefill is answering has ended (counted:
  ``write_behind_yields``); ``durable=True`` is answered once the disk copy exists; a publish
  that finds the write-behind queue full writes its disk copy before its answer; a steady
  stream of pulls delays each copy until a second after it was queued, not the queue's copies
  one after another.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

from statetier.daemon.engine import Engine, EngineOptions, Publishing
from statetier.daemon.requests import Incoming, LoadRequest, PutRequest, PutResult
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import NotFound
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import Keyring
from statetier.protocol.passes import PASSES
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.peer import PeerTier, PeerTierOptions
from statetier.tiers.peer import wire
from statetier.tiers.registry import MemoryVersionRegistry
from tests.support.waiting import eventually

NS = NamespaceSpec("peer-batches").namespace()
SPECS = (TensorSpec("k", "bfloat16", (4, 8, 16, 128)),)  # 128 KiB
PAYLOAD = 4 * 8 * 16 * 128 * 2
OBJECTS = 12


@contextlib.asynccontextmanager
async def node(url: str, name: str, keyring: Keyring, registry, folder, *, socket_buffer: int = 8 << 20,
               write_behind_limit: int = 256):
    host = HostTier(HostTierOptions(32 << 20, pin_memory=False))
    disk = DiskTier(DiskTierOptions(folder / name, 256 << 20, segment_bytes=4 << 20), keyring=keyring)

    async def holds_locally(object_id: bytes) -> bool:
        return await host.contains(object_id) or await disk.contains(object_id)

    peer = PeerTier(PeerTierOptions(url, owner_id=name, pull_timeout=2.0, socket_buffer_bytes=socket_buffer),
                    keyring=keyring, local_tiers=[host, disk], holds_locally=holds_locally)
    options = EngineOptions(producer_id=name, write_behind_limit=write_behind_limit)
    engine = Engine([host, disk, peer], keyring=keyring, registry=registry, arena=host, publishing=Publishing(peer),
                    write_behind_to=disk, options=options, batch_pulls=peer,
                    write_behind_yields_to=peer.server.quiet)
    await engine.start()
    try:
        yield engine, host, disk, peer
    finally:
        await engine.close()


async def publish_answers(engine: Engine, count: int, *, payload: int = PAYLOAD, durable: bool = False):
    """``count`` objects put with ``publish`` (and ``durable``) in one batch: their answers and payloads."""
    specs = (TensorSpec("k", "uint8", (payload,)),)
    payloads = [os.urandom(payload) for _ in range(count)]
    items = [Incoming(PutRequest("default", StateKey(NS, Kind.KV, layer, os.urandom(32), 0, 16), Provenance("r"),
                                 specs, publish=True, durable=durable), memoryview(data))
             for layer, data in enumerate(payloads)]
    puts = await engine.put_batch(items)
    assert all(isinstance(put, PutResult) and put.published for put in puts), puts
    return puts, payloads


async def publish(engine: Engine, count: int = OBJECTS, *, payload: int = PAYLOAD,
                  durable: bool = False) -> tuple[list, list[bytes]]:
    puts, payloads = await publish_answers(engine, count, payload=payload, durable=durable)
    assert [put.durable for put in puts] == [durable] * count
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


async def stalled_pull(address: str, meta, keyring: Keyring):
    """A daemon of the cluster that asks the owner for ``meta``'s object and reads none of it:
    the owner is answering a pull until the connection closes."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    key, nonce_p = wire.auth_key(keyring.active), os.urandom(wire.NONCE_BYTES)
    writer.write(wire.MAGIC + keyring.active.key_id + nonce_p)
    nonce_o = (await reader.readexactly(wire.WELCOME_BYTES))[8:40]
    session = wire.session_key(key, nonce_p, nonce_o)
    writer.write(wire.mac(key, b"puller", nonce_p, nonce_o)
                 + wire.pack_pull(session, meta.object_id, meta.namespace[-16:], meta.size, 1))
    await writer.drain()
    return writer


async def test_a_publish_is_answered_from_memory_its_disk_copy_written_after_the_pulls(fresh_redis, tmp_path):
    keyring, registry = Keyring.generate(), MemoryVersionRegistry()
    async with node(fresh_redis.url, "prefill", keyring, registry, tmp_path, socket_buffer=64 << 10) \
            as (prefill, host, disk, owner):
        big = (await publish(prefill, 1, payload=8 << 20))[0][0]
        await prefill.placement.flush_write_behind(10)
        writer = await stalled_pull(owner.server.address, await host.get_meta(big.state_id), keyring)
        await eventually(lambda: owner.server.answering == 1, "the owner answering the stalled pull")
        yields = prefill.placement.write_behind_yields
        (ref,), _ = await publish(prefill, 1)  # durable not asked: answered once in memory and described
        await eventually(lambda: prefill.placement.write_behind_yields == yields + 1, "the copy waiting for the pull")
        writer.close()  # the pull ends: the copy goes on
        await eventually(lambda: disk.contains(ref.state_id), "the published object's disk copy")


async def test_a_durable_publish_is_answered_once_its_disk_copy_exists(fresh_redis, tmp_path):
    keyring, registry = Keyring.generate(), MemoryVersionRegistry()
    async with node(fresh_redis.url, "prefill", keyring, registry, tmp_path) as (prefill, _, disk, _):
        (ref,), _ = await publish(prefill, 1, durable=True)
        assert await disk.contains(ref.state_id)  # on disk (fdatasync'd) before the answer
        plain, _ = await publish(prefill, 1)
        assert plain[0] is not None


async def test_a_publish_that_finds_the_write_behind_queue_full_is_written_before_its_answer(fresh_redis,
                                                                                              tmp_path):
    keyring, registry = Keyring.generate(), MemoryVersionRegistry()
    async with node(fresh_redis.url, "prefill", keyring, registry, tmp_path, write_behind_limit=1) \
            as (prefill, _, disk, _):
        puts, _ = await publish_answers(prefill, 3)
        assert [put.durable for put in puts[:2]] == [False, True]  # the first queued; the queue full after it
        for put in puts:  # each one durable when answered, or queued
            assert not put.durable or await disk.contains(put.ref.state_id)
        assert prefill.placement.write_behind_skipped == sum(put.durable for put in puts)
        for put in puts:
            await eventually(lambda: disk.contains(put.ref.state_id), "every published object's disk copy")


async def test_a_load_of_its_batch_that_finds_nothing_does_not_wait_for_the_batchs_own_pulls(fresh_redis, tmp_path):
    keyring, registry = Keyring.generate(), MemoryVersionRegistry()
    async with node(fresh_redis.url, "prefill", keyring, registry, tmp_path) as (prefill, _, _, _), \
            node(fresh_redis.url, "decode", keyring, registry, tmp_path) as (decode, host, _, _):
        refs, _ = await publish(prefill, 3)
        await prefill.delete("default", refs[0])  # in no tier, no longer described
        async with asyncio.timeout(10):  # it once waited for the promotions its own batch held open
            results = await decode.load_batch(loads(refs), "c")
        assert isinstance(results[0], NotFound) and results[1:] == [None, None]
        assert host.stats().bytes_used == 0 and decode.lease_count == 0  # the pulled ones given back


async def test_a_steady_stream_of_pulls_delays_each_disk_copy_never_the_queue_one_after_another(fresh_redis, tmp_path):
    keyring, registry = Keyring.generate(), MemoryVersionRegistry()
    async with node(fresh_redis.url, "prefill", keyring, registry, tmp_path, socket_buffer=64 << 10) \
            as (prefill, host, disk, owner):
        big = (await publish(prefill, 1, payload=8 << 20))[0][0]
        await prefill.placement.flush_write_behind(10)
        writer = await stalled_pull(owner.server.address, await host.get_meta(big.state_id), keyring)
        try:
            await eventually(lambda: owner.server.answering == 1, "the owner answering the stalled pull")
            refs, _ = await publish(prefill, 24)  # never quiet from here on: each copy waits its own second

            async def all_on_disk() -> bool:
                return all([await disk.contains(ref.state_id) for ref in refs])

            await eventually(all_on_disk, "every copy, the pull still open", timeout=12)  # one a second: 24 s
            assert owner.server.answering == 1
        finally:
            writer.close()
