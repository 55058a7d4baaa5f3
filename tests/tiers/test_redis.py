"""The Redis tier against real redis-server processes: one server and a 3-master cluster.

Each test tells one story: an object becomes visible only when its store completes, a
failed or cancelled store leaves no key behind, leases pin bytes, eviction takes the
exact LRU order, large objects cross many chunks, TTL expires objects, another node reads
what this one wrote, and anything that does not verify (foreign key, flipped byte) is
refused and dropped, as is an unreadable manifest. Then at-rest encryption. What a URL
can say (ACL users, unix sockets, TLS) is in ``test_redis_connect.py``.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from statetier.protocol.errors import (
    BadSignature,
    CapacityError,
    CorruptPayload,
    InvalidRequest,
    LeaseError,
    NotFound,
    UnknownKey,
)
from statetier.protocol.keyring import Keyring, SigningKey
from statetier.tiers.crypto import AtRestCipher
from statetier.tiers.redis.layout import PENDING_CHUNK_TTL, Manifest
from tests.support.redis_tier import KEYRING, keys_of, make_object, object_keys
from tests.support.tier_contract import assert_invisible, assert_visible, load, store
from tests.support.waiting import eventually

# -- lifecycle and visibility -----------------------------------------------------------


async def test_an_object_is_visible_only_after_its_store_completes(backend, make_tier) -> None:
    tier = await make_tier(backend.url, chunk_bytes=64 << 10)
    assert tier.is_cluster is backend.is_cluster
    meta, blob = make_object(300_000)
    ticket = await tier.prepare_store(meta)
    await tier.write(ticket, [blob[: meta.header_len], memoryview(blob)[meta.header_len :]])

    await assert_invisible(tier, meta)
    assert tier.stats().inflight == 1 and tier.stats().extra["reserved_bytes"] == meta.size
    pending = object_keys(backend.raw, tier.key_prefix, meta.object_id)
    assert len(pending) == 5 and all(b":p:" in key for key in pending)  # not under chunk names yet
    # an uncommitted chunk cannot outlive a dead store
    assert all(0 < backend.raw.ttl(key) <= PENDING_CHUNK_TTL for key in pending)

    await tier.complete_store(ticket, True)
    assert backend.raw.ttl(keys_of(tier).chunk(meta.object_id, 0)) == -1  # committed: no TTL configured
    await assert_visible(tier, meta)
    assert await load(tier, meta.object_id) == blob
    stats = tier.stats()
    assert (stats.objects, stats.bytes_used, stats.inflight, stats.leases) == (1, meta.size, 0, 0)
    assert stats.extra["available"] is True and stats.extra["reserved_bytes"] == 0
    # the manifest, then the header with 64 KiB of payload, then 64 KiB slices
    assert len(object_keys(backend.raw, tier.key_prefix, meta.object_id)) == 1 + 5


async def test_a_failed_store_leaves_no_key_and_no_reservation(backend, make_tier) -> None:
    tier = await make_tier(backend.url, chunk_bytes=100_000, capacity_bytes=10 << 20)
    meta, blob = make_object(250_000)
    ticket = await tier.prepare_store(meta)
    await tier.write(ticket, [blob])
    assert len(object_keys(backend.raw, tier.key_prefix, meta.object_id)) == 3

    await tier.complete_store(ticket, False)
    await tier.complete_store(ticket, False)  # twice is harmless
    assert object_keys(backend.raw, tier.key_prefix, meta.object_id) == []
    assert not await tier.contains(meta.object_id)
    assert tier.stats().extra["reserved_bytes"] == 0 and tier.stats().inflight == 0
    await store(tier, meta, blob)  # the id is free again
    assert await load(tier, meta.object_id) == blob


async def test_a_cancelled_write_leaves_nothing_and_the_tier_keeps_serving(backend, make_tier) -> None:
    tier = await make_tier(backend.url)
    meta, blob = make_object(24 << 20)
    ticket = await tier.prepare_store(meta)
    writing = asyncio.create_task(tier.write(ticket, [blob]))
    await asyncio.sleep(0)
    writing.cancel()
    try:
        await writing
    except asyncio.CancelledError:
        pass
    finally:
        await tier.complete_store(ticket, False)

    # A SET already on its way may still land after the cleanup; it is never visible and
    # it expires with the pending TTL.
    assert not await tier.contains(meta.object_id)
    leftovers = object_keys(backend.raw, tier.key_prefix, meta.object_id)
    assert all(b":p:" in key and 0 < backend.raw.ttl(key) <= PENDING_CHUNK_TTL for key in leftovers)
    other_meta, other_blob = make_object(3 << 20)
    await store(tier, other_meta, other_blob)
    assert await load(tier, other_meta.object_id) == other_blob


async def test_storing_an_object_twice_or_writing_the_wrong_size_is_invalid(backend, make_tier) -> None:
    tier = await make_tier(backend.url)
    meta, blob = make_object(1000)
    await store(tier, meta, blob)
    with pytest.raises(InvalidRequest):
        await tier.prepare_store(meta)

    other, other_blob = make_object(1000)
    ticket = await tier.prepare_store(other)
    with pytest.raises(InvalidRequest):
        await tier.prepare_store(other)  # already being stored
    with pytest.raises(InvalidRequest):
        await tier.write(ticket, [other_blob[:-1]])
    with pytest.raises(InvalidRequest):
        await tier.complete_store(ticket, True)  # nothing was written
    assert not await tier.contains(other.object_id)


# -- leases -----------------------------------------------------------------------------


async def test_closing_with_an_object_deleted_under_a_lease_erases_it_and_closes(backend, make_tier) -> None:
    """Regression: ``close`` dropped its client before erasing what was deleted under a lease,
    and the erase's accounting then raised ``RuntimeError`` (a daemon purging a namespace
    during loads exited 1 at shutdown)."""
    tier = await make_tier(backend.url, capacity_bytes=64 << 20)
    meta, blob = make_object(5000)
    await store(tier, meta, blob)
    await tier.prepare_load(meta.object_id, owner="conn-1")
    assert await tier.delete(meta.object_id) is True
    await tier.close()
    assert object_keys(backend.raw, tier.key_prefix, meta.object_id) == []


async def test_leases_pin_reads_and_delete_under_a_lease_hides_at_once(backend, make_tier) -> None:
    tier = await make_tier(backend.url, chunk_bytes=1 << 20, capacity_bytes=64 << 20)
    meta, blob = make_object(2_500_000)
    await store(tier, meta, blob)

    lease = await tier.prepare_load(meta.object_id, owner="conn-1")
    assert await tier.delete(meta.object_id) is True
    assert not await tier.contains(meta.object_id)  # hidden at once
    assert await tier.find_by_key(meta.key_digest) == []
    with pytest.raises(NotFound):
        await tier.prepare_load(meta.object_id)
    assert bytes(await tier.read(lease)) == blob  # the lease still reads it
    assert tier.stats().bytes_used == meta.size  # freed only when the last lease ends
    await tier.complete_load(lease)
    assert object_keys(backend.raw, tier.key_prefix, meta.object_id) == []
    assert tier.stats().bytes_used == 0
    with pytest.raises(LeaseError):
        await tier.read(lease)
    await tier.complete_load(lease)  # idempotent

    other, other_blob = make_object(1000)
    await store(tier, other, other_blob)
    first = await tier.prepare_load(other.object_id, owner="conn-2")
    second = await tier.prepare_load(other.object_id, owner="conn-2")
    assert tier.stats().leases == 2
    assert await tier.release_owner("conn-2") == 2
    with pytest.raises(LeaseError):
        await tier.read(first)
    with pytest.raises(LeaseError):
        await tier.read(second)
    assert await tier.delete(other.object_id) is True
    assert await tier.delete(other.object_id) is False


async def test_an_expired_lease_cannot_read(backend, make_tier, clock) -> None:
    tier = await make_tier(backend.url, clock=clock)
    meta, blob = make_object(1000)
    await store(tier, meta, blob)
    lease = await tier.prepare_load(meta.object_id, ttl=0.05)
    clock.advance(0.1)
    with pytest.raises(LeaseError):
        await tier.read(lease)


# -- capacity and eviction ----------------------------------------------------------------


async def test_eviction_takes_exact_lru_order_and_skips_leased_objects(backend, make_tier) -> None:
    a, b, c, d = (make_object(50_000, layer=i) for i in range(4))
    size = a[0].size
    tier = await make_tier(backend.url, capacity_bytes=10 * size, high_watermark=0.5, low_watermark=0.3)
    for meta, blob in (a, b, c, d):
        await store(tier, meta, blob)
    assert await load(tier, a[0].object_id) == a[1]  # A is now the most recently used
    held = await tier.prepare_load(c[0].object_id, owner="reader")  # C is pinned (and touched)

    assert await tier.evict(need_bytes=size) == []  # 5 sizes are not above the high watermark
    evicted = await tier.evict(need_bytes=2 * size)

    assert [e.meta.object_id for e in evicted] == [b[0].object_id, d[0].object_id, a[0].object_id]
    assert [bytes(e.blob) for e in evicted] == [b[1], d[1], a[1]]
    assert [m.object_id async for m in tier.iter_objects()] == [c[0].object_id]
    stats = tier.stats()
    assert (stats.objects, stats.bytes_used, stats.evictions) == (1, size, 3)
    assert bytes(await tier.read(held)) == c[1]
    await tier.complete_load(held)


async def test_eviction_stops_when_only_leased_objects_remain(backend, make_tier) -> None:
    objects = [make_object(50_000, layer=i) for i in range(3)]
    size = objects[0][0].size
    tier = await make_tier(backend.url, capacity_bytes=4 * size, high_watermark=0.5, low_watermark=0.25)
    for meta, blob in objects:
        await store(tier, meta, blob)
    leases = [await tier.prepare_load(meta.object_id) for meta, _ in objects[1:]]

    evicted = await tier.evict(need_bytes=size)
    assert [e.meta.object_id for e in evicted] == [objects[0][0].object_id]
    assert tier.stats().bytes_used == 2 * size  # still above the low watermark: all leased
    for lease in leases:
        await tier.complete_load(lease)


async def test_two_nodes_evicting_at_once_never_take_the_same_object(backend, make_tier) -> None:
    objects = [make_object(20_000, layer=i) for i in range(8)]
    size = objects[0][0].size
    options = dict(capacity_bytes=10 * size, high_watermark=0.5, low_watermark=0.2)
    node_a = await make_tier(backend.url, **options)
    node_b = await make_tier(backend.url, key_prefix=node_a.key_prefix, **options)
    for meta, blob in objects:
        await store(node_a, meta, blob)

    taken_a, taken_b = await asyncio.gather(node_a.evict(), node_b.evict())
    taken = [e.meta.object_id for e in taken_a + taken_b]
    assert len(taken) == len(set(taken)) >= 6  # down to the low watermark: 2 sizes or fewer remain
    assert {m.object_id async for m in node_a.iter_objects()}.isdisjoint(taken)


async def test_prepare_store_counts_reserved_and_leased_bytes(backend, make_tier) -> None:
    objects = [make_object(20_000, layer=i) for i in range(4)]
    size = objects[0][0].size
    tier = await make_tier(backend.url, capacity_bytes=3 * size)
    tickets = [await tier.prepare_store(meta) for meta, _ in objects[:3]]
    with pytest.raises(CapacityError):
        await tier.prepare_store(objects[3][0])
    await tier.complete_store(tickets[0], False)
    fourth = await tier.prepare_store(objects[3][0])
    for ticket in (tickets[1], tickets[2], fourth):
        await tier.complete_store(ticket, False)

    with pytest.raises(CapacityError):
        await tier.prepare_store(make_object(3 * size)[0])  # larger than the whole budget
    meta, blob = objects[0]
    await store(tier, meta, blob)
    leases = [await tier.prepare_load(meta.object_id)]
    for other, other_blob in objects[1:3]:
        await store(tier, other, other_blob)
        leases.append(await tier.prepare_load(other.object_id))
    with pytest.raises(CapacityError):  # all three are leased: nothing could be evicted
        await tier.prepare_store(objects[3][0])
    await tier.complete_load(leases[0])
    ticket = await tier.prepare_store(objects[3][0])  # evicting the first would make room
    await tier.complete_store(ticket, False)
    for lease in leases[1:]:
        await tier.complete_load(lease)


# -- large objects, TTL, another node ------------------------------------------------------


async def test_a_32_mib_object_crosses_many_chunks_and_comes_back_whole(backend, make_tier) -> None:
    tier = await make_tier(backend.url)
    meta, blob = make_object(32 << 20)
    await store(tier, meta, blob)
    keys = object_keys(backend.raw, tier.key_prefix, meta.object_id)
    assert len(keys) == 1 + 16  # the manifest, 16 chunks of 2 MiB of payload (the header rides in the first)
    assert await load(tier, meta.object_id) == blob
    assert await tier.delete(meta.object_id) is True
    assert object_keys(backend.raw, tier.key_prefix, meta.object_id) == []


async def test_objects_expire_with_their_ttl(backend, make_tier) -> None:
    tier = await make_tier(backend.url, ttl_seconds=1, capacity_bytes=1 << 20)
    meta, blob = make_object(1000)
    await store(tier, meta, blob)
    # Redis expires on its own clock, which a test cannot drive: the servers are local processes
    # on this machine's clock, and every key and budget entry of the object got its 1 s TTL before
    # now (on a cluster they live on different nodes, stamped at different moments of the store).
    expired_by = time.time() + 1 + 0.001
    manifest = keys_of(tier).manifest(meta.object_id)
    assert backend.raw.ttl(manifest) in (0, 1)
    assert tier.stats().objects == 1
    await eventually(lambda: time.time() > expired_by and not backend.raw.exists(manifest),
                     "the object's TTL passed and Redis expired its manifest", timeout=10)

    with pytest.raises(NotFound):
        await tier.prepare_load(meta.object_id)
    assert await tier.find_by_key(meta.key_digest) == []
    assert await tier.evict() == []
    assert (tier.stats().objects, tier.stats().bytes_used) == (0, 0)  # the budget forgot it too


async def test_missing_chunks_under_a_present_manifest_are_not_found_and_cleaned(backend, make_tier) -> None:
    tier = await make_tier(backend.url, chunk_bytes=4096)
    meta, blob = make_object(20_000)
    await store(tier, meta, blob)
    lease = await tier.prepare_load(meta.object_id)
    backend.raw.delete(keys_of(tier).chunk(meta.object_id, 2))
    with pytest.raises(NotFound):
        await tier.read(lease)
    await tier.complete_load(lease)
    assert object_keys(backend.raw, tier.key_prefix, meta.object_id) == []


async def test_an_object_written_by_one_node_is_read_and_verified_by_another(backend, make_tier) -> None:
    node_a = await make_tier(backend.url, chunk_bytes=1 << 20)
    node_b = await make_tier(backend.url, key_prefix=node_a.key_prefix)
    meta, blob = make_object(3 << 20, request_id="shared")
    await store(node_a, meta, blob)
    assert await node_b.find_by_key(meta.key_digest) == [meta]
    assert await load(node_b, meta.object_id) == blob
    assert await node_b.delete(meta.object_id) is True
    assert not await node_a.contains(meta.object_id)


# -- refusals -------------------------------------------------------------------------------


async def test_an_object_sealed_under_a_key_id_this_keyring_lacks_is_refused_and_left(backend, make_tier) -> None:
    """Another keyring's object (a daemon configured with its own keyring) is no damage:
    refused as ``UnknownKey`` on every read, never erased, not counted as corrupt."""
    tier = await make_tier(backend.url)
    meta, foreign = make_object(5000, keyring=Keyring.generate())
    keys = keys_of(tier)
    backend.raw.set(keys.chunk(meta.object_id, 0), foreign)
    backend.raw.set(keys.manifest(meta.object_id), Manifest(meta, len(foreign), 1, len(foreign), False).encode())

    for _ in range(2):
        lease = await tier.prepare_load(meta.object_id)
        with pytest.raises(UnknownKey, match="keys.keyring_file"):
            await tier.read(lease)
        await tier.complete_load(lease)
    assert await tier.contains(meta.object_id)
    assert backend.raw.get(keys.chunk(meta.object_id, 0)) == foreign
    assert tier.stats().extra["corrupt_dropped"] == 0


async def test_an_object_forged_under_this_keyrings_key_id_is_refused_and_dropped(backend, make_tier) -> None:
    tier = await make_tier(backend.url)
    forger = Keyring([SigningKey.from_secret(KEYRING.active.key_id, os.urandom(32))], KEYRING.active.key_id)
    meta, forged = make_object(5000, keyring=forger)
    keys = keys_of(tier)
    backend.raw.set(keys.chunk(meta.object_id, 0), forged)
    backend.raw.set(keys.manifest(meta.object_id), Manifest(meta, len(forged), 1, len(forged), False).encode())

    lease = await tier.prepare_load(meta.object_id)
    with pytest.raises(BadSignature) as refused:
        await tier.read(lease)
    await tier.complete_load(lease)
    assert not isinstance(refused.value, UnknownKey)
    assert not await tier.contains(meta.object_id)
    assert object_keys(backend.raw, tier.key_prefix, meta.object_id) == []
    assert tier.stats().extra["corrupt_dropped"] == 1


async def test_a_flipped_byte_in_one_chunk_is_corrupt_payload_and_dropped(backend, make_tier) -> None:
    tier = await make_tier(backend.url, chunk_bytes=64 << 10)
    meta, blob = make_object(200_000)
    await store(tier, meta, blob)
    chunk = keys_of(tier).chunk(meta.object_id, 2)
    original = backend.raw.getrange(chunk, 100, 100)
    backend.raw.setrange(chunk, 100, bytes([original[0] ^ 0x01]))

    with pytest.raises(CorruptPayload):
        await load(tier, meta.object_id)
    assert not await tier.contains(meta.object_id)
    assert object_keys(backend.raw, tier.key_prefix, meta.object_id) == []
    assert tier.stats().extra["corrupt_dropped"] == 1


async def test_at_rest_encryption_round_trips_and_stores_no_plaintext(backend, make_tier) -> None:
    cipher = AtRestCipher.generate()
    tier = await make_tier(backend.url, cipher=cipher, chunk_bytes=1 << 20)
    meta, blob = make_object(2_500_000)
    await store(tier, meta, blob)

    stored = b"".join(backend.raw.get(keys_of(tier).chunk(meta.object_id, i)) for i in range(3))
    assert blob[meta.header_len : meta.header_len + 4096] not in stored
    assert await load(tier, meta.object_id) == blob

    plain_node = await make_tier(backend.url, key_prefix=tier.key_prefix)  # no cipher configured
    with pytest.raises(CorruptPayload):
        await load(plain_node, meta.object_id)
    assert await tier.contains(meta.object_id)  # a node without the key does not drop it



async def test_an_unreadable_manifest_drops_the_object(backend, make_tier) -> None:
    tier = await make_tier(backend.url, chunk_bytes=1024)
    meta, blob = make_object(40_000)
    await store(tier, meta, blob)
    assert len(object_keys(backend.raw, tier.key_prefix, meta.object_id)) == 1 + 40  # more than one probe batch
    backend.raw.set(keys_of(tier).manifest(meta.object_id), b"{not json")
    assert await tier.get_meta(meta.object_id) is None
    with pytest.raises(CorruptPayload):
        await tier.prepare_load(meta.object_id)
    assert object_keys(backend.raw, tier.key_prefix, meta.object_id) == []
    assert tier.stats().extra["corrupt_dropped"] == 1
