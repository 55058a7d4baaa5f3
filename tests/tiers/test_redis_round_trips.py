"""The Redis tier's short paths keep every guarantee, on one server and on a cluster.

A store of a small object is one round trip and ``prepare_store`` asks Redis nothing about
an object this node has not seen, so the commit is what refuses an object another node
stored: it must leave that object whole and take its own pending chunks away. Scripts run
by SHA1 must survive a server that lost its script cache. A read that skips the signature
check of a header it verified before must still catch a flipped payload byte, a changed
header and a retired key. A batch lookup prunes index entries whose object is gone and
brings the registry's stream heads along. A commit repeated after its reply was lost is not mistaken for a
duplicate. A full connection pool waits, in bounded time, for a free one.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio.connection
import redis.exceptions

from statetier.protocol.errors import BadSignature, CorruptPayload, InvalidRequest
from statetier.protocol.keyring import Keyring
from statetier.tiers.redis.connect import BoundedWaitPool, exchange, open_client
from statetier.tiers.redis.layout import RedisKeys
from statetier.tiers.redis.registry import RedisVersionRegistry
from statetier.tiers.redis.scripts import Scripts
from statetier.tiers.registry import StreamHead
from tests.support.redis_tier import keys_of, make_object, object_keys  # noqa: F401  (fixtures are used by name)
from tests.support.tier_contract import load, store  # noqa: F401  (fixtures are used by name)


async def test_an_object_another_node_stored_is_refused_at_commit_and_stays_whole(backend, make_tier) -> None:
    node_a = await make_tier(backend.url, chunk_bytes=1 << 20)
    node_b = await make_tier(backend.url, key_prefix=node_a.key_prefix, chunk_bytes=1 << 20)
    for size in (1000, 3 << 20):  # sent with the commit; sent by write()
        meta, blob = make_object(size)
        await store(node_a, meta, blob)
        ticket = await node_b.prepare_store(meta)  # node B has never seen it
        await node_b.write(ticket, [blob])
        with pytest.raises(InvalidRequest):
            await node_b.complete_store(ticket, True)

        keys = object_keys(backend.raw, node_a.key_prefix, meta.object_id)
        assert not [key for key in keys if b":p:" in key]  # node B's pending chunks are gone
        assert all(backend.raw.ttl(key) == -1 for key in keys)  # node A's keep no pending TTL
        assert await load(node_a, meta.object_id) == blob
        assert await load(node_b, meta.object_id) == blob
        with pytest.raises(InvalidRequest):  # now node B knows it
            await node_b.prepare_store(meta)
        assert node_b.stats().extra["reserved_bytes"] == 0


async def test_a_server_that_lost_its_scripts_gets_them_again(backend, make_tier) -> None:
    tier = await make_tier(backend.url, capacity_bytes=64 << 20)
    small, small_blob = make_object(1000)
    large, large_blob = make_object(3 << 20)
    backend.raw.script_flush()
    await store(tier, small, small_blob)  # the commit rides with the chunk
    backend.raw.script_flush()
    await store(tier, large, large_blob)  # the commit goes alone
    backend.raw.script_flush()
    assert await load(tier, small.object_id) == small_blob  # the LRU touch rides with the MGET
    assert (tier.stats().objects, tier.stats().bytes_used) == (2, small.size + large.size)


async def test_a_header_verified_before_still_guards_every_read(backend, make_tier) -> None:
    keyring = Keyring.generate()
    tier = await make_tier(backend.url, keyring=keyring, chunk_bytes=64 << 10)
    (flipped, flipped_blob), (forged, forged_blob), (kept, kept_blob) = (
        make_object(200_000, keyring=keyring, layer=i) for i in range(3))
    for meta, blob in ((flipped, flipped_blob), (forged, forged_blob), (kept, kept_blob)):
        await store(tier, meta, blob)
        assert await load(tier, meta.object_id) == blob  # its header is verified and known now

    chunk = keys_of(tier).chunk(flipped.object_id, 2)  # payload only
    backend.raw.setrange(chunk, 100, bytes([backend.raw.getrange(chunk, 100, 100)[0] ^ 0x01]))
    with pytest.raises(CorruptPayload):
        await load(tier, flipped.object_id)
    chunk = keys_of(tier).chunk(forged.object_id, 0)  # a namespace byte, past the 32-byte prefix
    backend.raw.setrange(chunk, 40, bytes([backend.raw.getrange(chunk, 40, 40)[0] ^ 0x01]))
    with pytest.raises(BadSignature):
        await load(tier, forged.object_id)
    assert tier.stats().extra["corrupt_dropped"] == 2

    retired = keyring.active.key_id
    keyring.rotate()
    keyring.retire(retired)
    with pytest.raises(BadSignature):  # the key it was sealed under is no longer trusted
        await load(tier, kept.object_id)


async def test_a_commit_repeated_after_a_lost_reply_is_not_a_duplicate(redis_server) -> None:
    client, _ = await open_client(redis_server.url)
    scripts, keys, oid = Scripts(client), RedisKeys(f"rt-{uuid.uuid4().hex[:16]}"), bytes(16)
    await scripts.load_all()
    pending, final = keys.pending_chunks(oid, "s1", 1), keys.chunks(oid, 1)
    commit = scripts.command("commit", [keys.manifest(oid), *pending, *final], [b"manifest of s1", 0])
    assert (await exchange(client, [("SET", pending[0], b"chunk", "EX", 600), commit]))[1][0] == 1
    assert (await exchange(client, [commit]))[0][0] == 1  # the same store again: still committed
    second = keys.pending_chunks(oid, "s2", 1)
    other = scripts.command("commit", [keys.manifest(oid), *second, *final], [b"manifest of s2", 0])
    assert (await exchange(client, [("SET", second[0], b"other", "EX", 600), other]))[1][0] == -1
    assert await client.mget([keys.manifest(oid), final[0], pending[0], second[0]]) == [
        b"manifest of s1", b"chunk", None, None]  # the first store stands; the second left nothing
    assert await client.ttl(final[0]) == -1
    await client.delete(keys.manifest(oid), final[0])
    await client.aclose()


async def test_a_full_pool_waits_for_a_free_connection_in_bounded_time(redis_server) -> None:
    pool = BoundedWaitPool.from_url(redis_server.url, max_connections=2, timeout=0.2)
    held = [await pool.get_connection(), await pool.get_connection()]
    waiting = asyncio.create_task(pool.get_connection())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiting.done()

    await pool.release(held.pop())
    held.append(await asyncio.wait_for(waiting, 30))  # the bound only catches a hang
    with pytest.raises(redis.exceptions.ConnectionError):
        await pool.get_connection()  # both are held: the 0.2 s wait runs out
    for connection in held:
        await pool.release(connection)
    again = await pool.get_connection()  # the fast path once one is free
    await pool.release(again)
    await pool.aclose()


async def test_a_batch_lookup_prunes_gone_entries_and_brings_the_stream_heads(backend, make_tier) -> None:
    tier = await make_tier(backend.url)
    registry = RedisVersionRegistry(backend.url, key_prefix=tier.key_prefix)
    (fresh, fresh_blob), (old, old_blob), (gone, gone_blob) = (make_object(1000, layer=i) for i in range(3))
    for meta, blob in ((fresh, fresh_blob), (old, old_blob), (gone, gone_blob)):
        await store(tier, meta, blob)
    await registry.claim(fresh.stream_id, b"\x01" * 16)
    keys = keys_of(tier)
    backend.raw.delete(keys.manifest(gone.object_id))  # expired, or deleted by another node
    backend.raw.hset(keys.key_index(old.key_digest), old.object_id.hex(), old.version)  # before stream ids

    found = await tier.find_by_keys([fresh.key_digest, old.key_digest, gone.key_digest], registry)
    assert found.metas == [[fresh], [old], []]
    assert found.heads[fresh.stream_id] == StreamHead(1, b"\x01" * 16)
    assert found.heads[gone.stream_id] is None  # asked along with its manifest: never claimed here
    assert old.stream_id not in found.heads  # its entry names no stream: the caller asks for it
    assert backend.raw.hkeys(keys.key_index(gone.key_digest)) == []  # pruned
    assert (await tier.find_by_keys([fresh.key_digest])).heads == {}  # no registry, no heads
    assert await registry.newest_many([fresh.stream_id, old.stream_id]) == [StreamHead(1, b"\x01" * 16), None]
    await registry.close()


async def test_a_small_object_loads_in_one_round_trip_and_a_large_lease_holds_no_chunk(redis_server, make_tier,
                                                                                       monkeypatch) -> None:
    tier = await make_tier(redis_server.url, capacity_bytes=64 << 20, chunk_bytes=1 << 20)
    small, small_blob = make_object(60_000)
    large, large_blob = make_object(3 << 20, layer=1)
    for meta, blob in ((small, small_blob), (large, large_blob)):
        await store(tier, meta, blob)
    assert await load(tier, large.object_id) == large_blob  # the pool has its connections open
    sends = []
    send = redis.asyncio.connection.AbstractConnection.send_packed_command

    async def counted(connection, *args, **kwargs):
        sends.append(1)
        return await send(connection, *args, **kwargs)

    monkeypatch.setattr(redis.asyncio.connection.AbstractConnection, "send_packed_command", counted)
    lease = await tier.prepare_load(small.object_id)  # the manifest, the whole chunk, the LRU touch
    assert bytes(await tier.read(lease)) == small_blob
    assert len(sends) == 1
    await tier.complete_load(lease)
    lease = await tier.prepare_load(large.object_id)
    assert len(lease.location.head) < len(large_blob) // 20  # a bounded prefix, never a whole chunk
    assert bytes(await tier.read(lease)) == large_blob
    chunks = lease.location.manifest.chunks
    assert chunks >= 3 and len(sends) == 2 + min(chunks, 4)  # over up to 4 connections at once
    await tier.complete_load(lease)


def script_calls(backend) -> int:
    """EVALSHA calls the server (every node of a cluster) ran so far (``INFO commandstats``)."""
    if backend.is_cluster:
        found = backend.raw.info("commandstats", target_nodes=backend.raw.ALL_NODES).values()
    else:
        found = [backend.raw.info("commandstats")]
    return sum(stats.get("cmdstat_evalsha", {}).get("calls", 0) for stats in found)


async def test_a_batch_of_objects_commits_in_one_script_call(backend, make_tier) -> None:
    # issue 25: a batch (a whole request's group objects) commits with one script call on a
    # server (12 redis.calls per object inside it, not 12 per object in a call each); a
    # cluster, whose objects live in other slots, commits each in its own slot, in one
    # pipeline. Every object is then whole and indexed, the accounting counts them all, and
    # an object another node stored first is refused alone, left whole.
    tier = await make_tier(backend.url, chunk_bytes=1 << 20)
    other = await make_tier(backend.url, key_prefix=tier.key_prefix, chunk_bytes=1 << 20)
    objects = [make_object(size, layer=layer) for layer, size in enumerate((1000, 70_000, 3 << 20, 2000))]
    taken_meta, taken_blob = objects[1]
    await store(other, taken_meta, taken_blob)  # another node stored this state_id first
    tickets = []
    for meta, blob in objects:
        ticket = await tier.prepare_store(meta)  # this node never saw it: no round trip
        await tier.write(ticket, [blob])  # the 3 MiB object sends its chunks now, the others wait
        tickets.append(ticket)

    before = script_calls(backend)
    outcome = await tier.complete_stores(tickets)
    calls = script_calls(backend) - before

    assert [type(e).__name__ if e else None for e in outcome] == [None, "InvalidRequest", None, None]
    # one commit for the batch; a cluster: one commit per object, then one accounting each
    assert calls == (1 if not backend.is_cluster else 2 * len(objects) - 1)
    for meta, blob in objects:
        assert await load(tier, meta.object_id) == blob
        assert not [key for key in object_keys(backend.raw, tier.key_prefix, meta.object_id) if b":p:" in key]
    found = await tier.find_by_keys([meta.key_digest for meta, _ in objects])
    assert [[m.object_id for m in metas] for metas in found.metas] == [[meta.object_id] for meta, _ in objects]
    assert (tier.stats().objects, tier.stats().bytes_used) == (len(objects), sum(m.size for m, _ in objects))
    assert tier.stats().extra["reserved_bytes"] == 0


async def test_a_read_into_lands_every_chunk_in_place_and_checks_it_there(backend, make_tier) -> None:
    # a promotion reads straight into its arena reservation: the chunks copied into place one
    # by one (no joined buffer); a flipped payload byte is found there by ``read(into=…)`` and
    # the object dropped, passed on with ``verify=False`` (the client checks it); another
    # size than the destination's is refused before a byte is written, and nothing is dropped
    tier = await make_tier(backend.url, chunk_bytes=1 << 20)
    (whole, whole_blob), (flipped, flipped_blob) = (make_object(3 << 20, layer=i) for i in range(2))
    for meta, blob in ((whole, whole_blob), (flipped, flipped_blob)):
        await store(tier, meta, blob)
    chunk = keys_of(tier).chunk(flipped.object_id, 2)
    backend.raw.setrange(chunk, 100, bytes([backend.raw.getrange(chunk, 100, 100)[0] ^ 0x01]))

    async def read_into(meta, verify, size=None):
        dest = memoryview(bytearray(size or meta.size))
        lease = await tier.prepare_load(meta.object_id)
        try:
            await tier.read(lease, into=dest, verify=verify)
        finally:
            await tier.complete_load(lease)
        return bytes(dest)

    assert await read_into(whole, True) == whole_blob
    assert await read_into(flipped, False) != flipped_blob
    with pytest.raises(InvalidRequest):
        await read_into(whole, True, whole.size + 1)
    with pytest.raises(CorruptPayload):
        await read_into(flipped, True)
    assert not await tier.contains(flipped.object_id)
    assert await tier.contains(whole.object_id)


async def test_a_batch_lookup_brings_the_clusters_purge_marks_in_its_first_round_trip(backend, make_tier,
                                                                                       monkeypatch) -> None:
    # another daemon's purge must be honoured before what a lookup located is served; the
    # marks ride on the key indexes' round trip, so a lookup costs no round trip more
    tier = await make_tier(backend.url)
    meta, blob = make_object(1000)
    await store(tier, meta, blob)
    assert (await tier.find_by_keys([meta.key_digest])).purge_marks == {}
    await tier.mark_purge("ns:" + "ab" * 32, 1234)
    await tier.mark_purge("tenant:b", 99)
    exchanges: list[int] = []
    real = exchange

    async def counted(client, commands):
        exchanges.append(len(commands))
        return await real(client, commands)

    monkeypatch.setattr("statetier.tiers.redis.connect.exchange", counted)
    found = await tier.find_by_keys([meta.key_digest])
    assert found.purge_marks == {"ns:" + "ab" * 32: 1234, "tenant:b": 99}
    assert found.metas == [[meta]]
    assert exchanges == [2, 1]  # trip 1: the key index and the marks; trip 2: the manifest
    assert (await tier.find_by_keys([])).purge_marks is None  # nothing asked, nothing read
