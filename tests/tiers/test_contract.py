"""The tier contract (tiers.base, DESIGN §5–6), told once and run against every tier.

Each story runs on host, device (cpu), disk, Redis, a three-master Redis Cluster and the peer
tier (fixtures in ``tests/support/tier_contract.py``): an object is invisible until ``complete_store(True)``
and reads back byte for byte; ``complete_store(False)`` gives every byte back; a caller
cancelled before or inside any await of a store or a load leaves nothing behind
(``test_contract_cancellation.py``); duplicates, absent objects, used and expired leases
fail with the documented errors; a leased object deleted stays readable through its lease;
capacity counts reservations; eviction returns the exact LRU sequence with its bytes; and
a tier reports what it holds: another object's intact bytes stored under an id read back
as they are, neither refused nor dropped (judging them is the engine's, issue 12); a group
object (issue 21) comes back with its group key and every layer's regions.

What differs is declared by the tier, and the stories read the declaration, never a tier's
name: a tier that takes no bytes of its own (``holds_bytes = False``, the peer tier) is
handed its objects by their owner (another daemon's tiers, over the real transport), refuses
bytes it does not hold, lists and evicts nothing; the stories about its own stores, room,
eviction and deletes under a lease are skipped for it, the skip naming the declaration.
"""

from __future__ import annotations

import os

import pytest

from statetier.protocol.classify import open_intact
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.errors import BadSignature, CapacityError, CorruptPayload, InvalidRequest, LeaseError
from statetier.protocol.groups import LayerGroup, region_name, split_region_name
from statetier.protocol.identity import Kind, Provenance, new_state_id
from statetier.protocol.sealed import decode_header, seal_object
from statetier.tiers.base import ObjectMeta
from tests.support.tier_contract import (  # noqa: F401  (fixtures are used by name)
    CAPACITY,
    KEYRING,
    NAMESPACE,
    assert_full_capacity_fits,
    assert_invisible,
    assert_quiet,
    assert_visible,
    chunks_of,
    executor,
    listed,
    load,
    make_object,
    needs_bytes,
    object_of_size,
    remove,
    store,
    tier,
)

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------- store lifecycle


async def test_an_object_is_visible_only_after_its_store_completes(tier):
    needs_bytes(tier, "it takes no store of bytes (its owner's tiers do)")
    meta, blob = make_object()
    ticket = await tier.prepare_store(meta)
    await assert_invisible(tier, meta)
    await tier.write(ticket, chunks_of(meta, blob))
    await assert_invisible(tier, meta)
    assert tier.stats().inflight == 1

    await tier.complete_store(ticket, success=True)

    await assert_visible(tier, meta)
    assert await load(tier, meta.object_id) == blob
    await assert_quiet(tier, 1, meta.size)


async def test_many_keys_are_found_at_once_as_one_by_one(tier):
    first, first_blob = make_object()
    second, second_blob = make_object()
    absent, _ = make_object()
    for meta, blob in ((first, first_blob), (second, second_blob)):
        await store(tier, meta, blob)
    digests = [second.key_digest, absent.key_digest, first.key_digest, second.key_digest]
    found = await tier.find_by_keys(digests)
    assert found.metas == [[second], [], [first], [second]]
    assert found.metas == [await tier.find_by_key(digest) for digest in digests]
    assert (await tier.find_by_keys([])).metas == []
    for meta in (first, second):
        lease = await tier.prepare_load(meta.object_id, owner="probe")  # after a lookup, as a lookup leases
        await tier.complete_load(lease)


async def test_a_failed_store_leaves_nothing_and_gives_back_every_byte(tier):
    needs_bytes(tier, "it takes no store of bytes to fail")
    kept, kept_blob = make_object()
    await store(tier, kept, kept_blob)
    meta, blob = make_object()
    ticket = await tier.prepare_store(meta)
    await tier.write(ticket, chunks_of(meta, blob))

    await tier.complete_store(ticket, success=False)
    await tier.complete_store(ticket, success=False)  # twice changes nothing

    await assert_invisible(tier, meta)
    await assert_quiet(tier, 1, kept.size)
    assert await tier.delete(kept.object_id)
    await assert_quiet(tier, 0, 0)
    await assert_full_capacity_fits(tier)


async def test_storing_an_object_id_twice_is_refused(tier):
    needs_bytes(tier, "it takes no store of bytes (the first would be refused)")
    meta, blob = make_object()
    ticket = await tier.prepare_store(meta)
    with pytest.raises(InvalidRequest):  # while the first store is in flight
        await tier.prepare_store(meta)
    await tier.write(ticket, chunks_of(meta, blob))
    await tier.complete_store(ticket, success=True)

    with pytest.raises(InvalidRequest):  # once it is stored
        await tier.prepare_store(meta)

    assert await load(tier, meta.object_id) == blob
    await assert_quiet(tier, 1, meta.size)


async def test_an_absent_object_is_not_found(tier):
    meta, _ = make_object()
    await assert_invisible(tier, meta)
    assert await tier.delete(meta.object_id) is False
    await assert_quiet(tier, 0, 0)


async def test_another_objects_intact_bytes_under_an_id_read_back_as_found(tier):
    mine, _ = make_object()
    theirs, their_blob = make_object()
    assert theirs.size == mine.size and theirs.object_id != mine.object_id
    await store(tier, mine, their_blob)  # a writer that mixed up two keys
    assert await load(tier, mine.object_id) == their_blob
    assert await tier.contains(mine.object_id)
    assert tier.stats().extra.get("corrupt_dropped", 0) == 0


async def test_a_read_unhashed_skips_the_payload_digest_and_nothing_else(tier):
    # ``read(verify=False)``, what a load reads with (the hashing rule, docs/protocol.md §6.1): a flipped payload
    # byte comes back as stored, for the client's check where it lands; ``read`` of a tier
    # that verifies on read finds it and drops the copy; a flipped header byte fails the
    # signature on either read of such a tier
    meta, blob = make_object()
    damaged = bytearray(blob)
    damaged[-1] ^= 0x01
    await store(tier, meta, bytes(damaged))
    lease = await tier.prepare_load(meta.object_id)
    try:
        assert bytes(await tier.read(lease, verify=False)) == bytes(damaged)
    finally:
        await tier.complete_load(lease)
    assert await tier.contains(meta.object_id)
    if tier.verifies_on_read:
        with pytest.raises(CorruptPayload):
            await load(tier, meta.object_id)
        assert not await tier.contains(meta.object_id)
        assert tier.stats().extra["corrupt_dropped"] == 1

        forged, forged_blob = make_object()
        forged_bytes = bytearray(forged_blob)
        forged_bytes[forged.header_len // 2] ^= 0x01
        await store(tier, forged, bytes(forged_bytes))
        lease = await tier.prepare_load(forged.object_id)
        try:
            with pytest.raises(BadSignature):
                await tier.read(lease, verify=False)
        finally:
            await tier.complete_load(lease)
    elif not tier.holds_bytes:  # the copy is its owner's: a hashed read refuses it, nothing here to drop
        with pytest.raises(CorruptPayload):
            await load(tier, meta.object_id)
        assert await tier.contains(meta.object_id)
    else:
        assert await load(tier, meta.object_id) == bytes(damaged)  # digested by no one but the client


# ---------------------------------------------------------------------------- leases


async def test_a_completed_lease_can_no_longer_read(tier):
    meta, blob = make_object()
    await store(tier, meta, blob)
    lease = await tier.prepare_load(meta.object_id, owner="reader")
    assert bytes(await tier.read(lease)) == blob
    await tier.complete_load(lease)
    await tier.complete_load(lease)  # idempotent

    with pytest.raises(LeaseError):
        await tier.read(lease)
    await assert_quiet(tier, 1, meta.size)


async def test_an_expired_lease_fails_and_is_dropped(tier, clock):
    meta, blob = make_object()
    await store(tier, meta, blob)
    lease = await tier.prepare_load(meta.object_id, owner="slow", ttl=0.05)
    assert tier.stats().leases == 1

    clock.advance(0.1)

    with pytest.raises(LeaseError):
        await tier.read(lease)
    assert tier.stats().leases == 0
    await tier.complete_load(lease)
    assert await load(tier, meta.object_id) == blob
    await assert_quiet(tier, 1, meta.size)


async def test_release_owner_drops_exactly_that_owners_leases(tier):
    (a, a_blob), (b, b_blob) = make_object(), make_object()
    await store(tier, a, a_blob)
    await store(tier, b, b_blob)
    alice = [await tier.prepare_load(a.object_id, owner="alice"), await tier.prepare_load(b.object_id, owner="alice")]
    bob = await tier.prepare_load(a.object_id, owner="bob")
    assert tier.stats().leases == 3

    assert await tier.release_owner("alice") == 2

    assert tier.stats().leases == 1
    for lease in alice:
        with pytest.raises(LeaseError):
            await tier.read(lease)
    assert bytes(await tier.read(bob)) == a_blob
    await tier.complete_load(bob)
    assert await tier.release_owner("alice") == 0
    await assert_quiet(tier, 2, a.size + b.size)


async def test_deleting_a_leased_object_hides_it_and_frees_it_after_the_last_lease(tier):
    needs_bytes(tier, "the copy is its owner's: a lease here pins nothing there")
    (meta, blob), (other, other_blob) = make_object(), make_object()
    await store(tier, meta, blob)
    await store(tier, other, other_blob)
    lease = await tier.prepare_load(meta.object_id, owner="reader")

    assert await tier.delete(meta.object_id) is True

    await assert_invisible(tier, meta)
    assert await listed(tier) == [other]
    assert bytes(await tier.read(lease)) == blob  # the existing lease still reads the right bytes
    assert tier.stats().bytes_used == meta.size + other.size  # pinned by the lease
    await tier.complete_load(lease)
    await assert_quiet(tier, 1, other.size)
    assert await tier.delete(other.object_id)
    await assert_full_capacity_fits(tier)


async def test_a_deleted_object_whose_lease_expired_is_freed(tier, clock):
    needs_bytes(tier, "the copy is its owner's: a lease here pins nothing there")
    meta, blob = make_object()
    await store(tier, meta, blob)
    lease = await tier.prepare_load(meta.object_id, owner="slow", ttl=0.05)
    assert await tier.delete(meta.object_id)

    clock.advance(0.1)

    try:
        with pytest.raises(LeaseError):
            await tier.read(lease)
    finally:
        await tier.complete_load(lease)
    await assert_invisible(tier, meta)
    await assert_quiet(tier, 0, 0)
    await assert_full_capacity_fits(tier)


# ---------------------------------------------------------------------------- capacity


async def test_capacity_counts_reservations_and_refuses_what_cannot_fit(tier):
    needs_bytes(tier, "it has no room to count")
    too_big, _ = object_of_size(CAPACITY + 1)
    with pytest.raises(CapacityError):
        await tier.prepare_store(too_big)

    (first, _first_blob), (second, second_blob) = object_of_size(CAPACITY // 2 + 1), object_of_size(CAPACITY // 2 + 1)
    ticket = await tier.prepare_store(first)
    with pytest.raises(CapacityError):  # the first reservation holds more than half
        await tier.prepare_store(second)
    await tier.complete_store(ticket, success=False)

    await store(tier, second, second_blob)
    assert await load(tier, second.object_id) == second_blob
    await assert_quiet(tier, 1, second.size)
    await assert_invisible(tier, first)


async def test_a_leased_object_holds_its_room_until_released_and_evicted(tier):
    needs_bytes(tier, "it has no room to hold")
    (first, first_blob), (second, second_blob) = object_of_size(CAPACITY // 2 + 1), object_of_size(CAPACITY // 2 + 1)
    await store(tier, first, first_blob)
    lease = await tier.prepare_load(first.object_id, owner="reader")

    assert await tier.evict(second.size) == []  # nothing unleased to give up
    with pytest.raises(CapacityError):
        await tier.prepare_store(second)
    await tier.complete_load(lease)

    # as the daemon does it: make room, demote what comes back, then store
    evicted = await tier.evict(second.size)
    assert [(e.meta, bytes(e.blob)) for e in evicted] == [(first, first_blob)]
    await store(tier, second, second_blob)
    assert await load(tier, second.object_id) == second_blob
    await assert_quiet(tier, 1, second.size)


# ---------------------------------------------------------------------------- eviction


async def test_eviction_takes_the_exact_lru_order_and_skips_leased_objects(tier):
    needs_bytes(tier, "it evicts nothing")
    objects = dict(zip("ABCDEF", (make_object() for _ in range(6))))
    for meta, blob in objects.values():
        await store(tier, meta, blob)
    size = objects["A"][0].size  # every object of this suite has this size
    assert tier.stats().bytes_used == 6 * size

    assert await tier.evict(0) == []  # 6 of 8 slots: under the high watermark
    assert await load(tier, objects["B"][0].object_id) == objects["B"][1]  # B becomes most recent
    pinned = await tier.prepare_load(objects["C"][0].object_id, owner="pinner")

    # 6 + 2 of 8 slots passes 0.9; two unleased objects out, oldest first, bring it to 0.75
    evicted = await tier.evict(2 * size)

    assert [e.meta.object_id for e in evicted] == [objects[n][0].object_id for n in "AD"]
    for e, name in zip(evicted, "AD"):
        assert e.meta == objects[name][0]
        assert bytes(e.blob) == objects[name][1]
        await assert_invisible(tier, e.meta)
    assert sorted(m.object_id for m in await listed(tier)) == sorted(objects[n][0].object_id for n in "BCEF")
    stats = tier.stats()
    assert (stats.objects, stats.bytes_used, stats.leases, stats.evictions) == (4, 4 * size, 1, 2)
    assert await tier.evict(2 * size) == []  # 4 + 2 of 8: under the high watermark again

    assert bytes(await tier.read(pinned)) == objects["C"][1]
    await tier.complete_load(pinned)
    await assert_quiet(tier, 4, 4 * size)


async def test_stats_count_objects_bytes_leases_and_stores_in_flight(tier):
    needs_bytes(tier, "it counts no objects, bytes or stores of its own")
    stats = tier.stats()
    assert (stats.tier, stats.capacity, stats.objects, stats.bytes_used) == (tier.name, CAPACITY, 0, 0)
    stored = [make_object() for _ in range(3)]
    for meta, blob in stored:
        await store(tier, meta, blob)
    total = sum(meta.size for meta, _ in stored)
    await assert_quiet(tier, 3, total)

    pending, _ = make_object()
    ticket = await tier.prepare_store(pending)
    lease = await tier.prepare_load(stored[0][0].object_id, owner="reader")
    stats = tier.stats()
    assert (stats.objects, stats.leases, stats.inflight) == (3, 1, 2)

    await tier.complete_load(lease)
    await tier.complete_store(ticket, success=False)
    await assert_quiet(tier, 3, total)
    for meta, _ in stored:
        assert await tier.delete(meta.object_id)
    await assert_quiet(tier, 0, 0)


async def test_a_group_object_round_trips_with_every_layers_region(tier):
    group = LayerGroup(Kind.KV, 2, (5, 11, 17))
    key = group.key(NAMESPACE, os.urandom(32), 256, 512, shard=1)
    regions = {layer: {name: os.urandom(8 * 1024) for name in ("k", "v")} for layer in group.layers}
    blob = seal_object(key, Provenance("contract-group", 3, "contract", 1),
                       [(TensorSpec(region_name(layer, name), "uint8", (len(data),)), data)
                        for layer in group.layers for name, data in regions[layer].items()],
                       keyring=KEYRING, state_id=new_state_id(), version=1)
    meta = ObjectMeta.from_header(decode_header(blob))
    await store(tier, meta, blob)

    assert await tier.find_by_key(key.digest()) == [meta]
    opened = open_intact(await load(tier, meta.object_id), KEYRING)
    assert opened.header.key == key and LayerGroup.of_key(opened.header.key) == group
    assert [t.spec.name for t in opened.header.tensors] == ["5.k", "5.v", "11.k", "11.v", "17.k", "17.v"]
    for t in opened.header.tensors:
        layer, name = split_region_name(t.spec.name)
        assert bytes(opened.payload[t.offset : t.offset + t.nbytes]) == regions[layer][name]
    assert await remove(tier, meta.object_id)
    await assert_quiet(tier, 0, 0)


# ---------------------------------------------------------------------------- a tier that takes no bytes


async def test_a_tier_that_holds_no_bytes_takes_none_lists_none_and_evicts_none(tier):
    if tier.holds_bytes:
        pytest.skip("holds_bytes = True: the other stories tell what it holds")
    meta, blob = make_object()
    with pytest.raises(CapacityError):  # bytes it does not hold: a demotion goes further down
        await tier.prepare_store(meta)
    await store(tier, meta, blob)  # held, and described, by its owner

    assert await load(tier, meta.object_id) == blob  # pulled from the owner
    with pytest.raises(CapacityError):  # found, but still not held here
        await tier.prepare_store(meta)
    assert await listed(tier) == [] and await tier.evict(CAPACITY) == []
    stats = tier.stats()
    assert (stats.capacity, stats.objects, stats.bytes_used, stats.leases) == (0, 0, 0, 0)
    assert await tier.delete(meta.object_id) is False  # another daemon's to withdraw
    assert await tier.contains(meta.object_id)
    assert await remove(tier, meta.object_id)
    assert not await tier.contains(meta.object_id)
