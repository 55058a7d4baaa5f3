"""The disk tier on real segment files and a real LMDB index, in ``tmp_path``.

Each test tells one story: the store lifecycle and its visibility rules, a restart that
keeps every completed object, the exact LRU eviction order, a flipped byte refused and
dropped, at-rest encryption, and a full filesystem (where a delete still works).
Cancellation is in ``test_disk_cancellation.py``, compaction in ``test_disk_compaction.py``,
the log itself — an index that lost its last checkpoints, a torn tail — in
``test_disk_log.py``.
"""

from __future__ import annotations

import errno
import os
import subprocess
from dataclasses import replace

import lmdb
import pytest

from statetier.protocol.errors import (
    CapacityError,
    CorruptPayload,
    InternalError,
    InvalidRequest,
    LeaseError,
    NotFound,
    Unavailable,
)
from statetier.tiers.crypto import AtRestCipher
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.disk.index import DiskIndex, IndexEntry, Location, Put
from statetier.tiers.disk.jobs import translate_error
from statetier.tiers.disk.segments import RECORD_HEADER_BYTES
from tests.support.disk_crash_writer import KEYRING, load, make_object, object_id_for, store
from tests.support.disk_files import objects, segment_files
from tests.support.scripts import REPO, module_command

WRITER = "tests.support.disk_crash_writer"


# ---------------------------------------------------------------------------- lifecycle


async def test_a_stored_object_is_visible_and_reads_back_verified(open_disk, tmp_path):
    tier = await open_disk()
    meta, blob = make_object(object_id_for(1, 0, 0))
    DiskTier(DiskTierOptions(tmp_path / "elsewhere", 1 << 20), keyring=KEYRING)
    assert not (tmp_path / "elsewhere").exists()  # constructors have no side effects

    await store(tier, meta, blob)

    assert await tier.contains(meta.object_id)
    assert await tier.get_meta(meta.object_id) == meta
    assert await tier.find_by_key(meta.key_digest) == [meta]
    assert [m async for m in tier.iter_objects()] == [meta]
    assert await load(tier, meta.object_id) == blob
    stats = tier.stats()
    assert (stats.objects, stats.bytes_used, stats.leases, stats.inflight) == (1, meta.size, 0, 0)
    assert stats.extra["live_record_bytes"] == RECORD_HEADER_BYTES + meta.size


async def test_an_object_is_invisible_until_its_store_completes(open_disk):
    tier = await open_disk()
    (meta, blob), (other, other_blob) = objects(2)
    ticket = await tier.prepare_store(meta)
    await tier.write(ticket, [blob])

    assert not await tier.contains(meta.object_id)
    assert await tier.find_by_key(meta.key_digest) == []
    with pytest.raises(NotFound):
        await tier.prepare_load(meta.object_id)
    with pytest.raises(InvalidRequest):
        await tier.prepare_store(meta)  # already being stored
    assert tier.stats().inflight == 1 and tier.stats().extra["reserved_bytes"] == meta.size

    await tier.complete_store(ticket, False)
    await tier.complete_store(ticket, False)  # twice is harmless

    assert not await tier.contains(meta.object_id)
    assert (tier.stats().inflight, tier.stats().extra["reserved_bytes"], tier.stats().bytes_used) == (0, 0, 0)
    with pytest.raises(InvalidRequest):
        await tier.complete_store(ticket, True)

    half = await tier.prepare_store(other)
    await tier.write(half, [other_blob[:100]])
    with pytest.raises(InvalidRequest):
        await tier.complete_store(half, True)  # a torn write never becomes visible
    assert not await tier.contains(other.object_id)

    await store(tier, meta, blob)
    with pytest.raises(InvalidRequest):
        await tier.prepare_store(meta)  # already present


async def test_prepare_store_counts_reservations_and_leases_against_capacity(open_disk):
    (a, blob_a), (b, _), (c, _) = objects(3, size=4000)
    tier = await open_disk(capacity=a.size * 2)
    with pytest.raises(CapacityError):
        await tier.prepare_store(make_object(object_id_for(1, 9, 0), 3 * 4000)[0])
    await store(tier, a, blob_a)
    ticket = await tier.prepare_store(b)
    lease = await tier.prepare_load(a.object_id)
    with pytest.raises(CapacityError):
        await tier.prepare_store(c)  # a is leased and b reserved: nothing could be evicted
    await tier.complete_load(lease)
    await tier.complete_store(ticket, False)
    await tier.complete_store(await tier.prepare_store(c), False)


async def test_a_deleted_object_stays_readable_under_its_lease_until_released(open_disk):
    tier = await open_disk()
    meta, blob = make_object(object_id_for(1, 0, 0))
    await store(tier, meta, blob)
    lease = await tier.prepare_load(meta.object_id, owner="conn-1")

    assert await tier.delete(meta.object_id)
    assert not await tier.contains(meta.object_id)
    with pytest.raises(NotFound):
        await tier.prepare_load(meta.object_id)
    assert bytes(await tier.read(lease)) == blob
    assert tier.stats().bytes_used == meta.size

    assert await tier.release_owner("conn-1") == 1
    assert tier.stats().bytes_used == 0
    with pytest.raises(LeaseError):
        await tier.read(lease)
    assert not await tier.delete(meta.object_id)


# ---------------------------------------------------------------------------- restart


async def test_a_restart_keeps_every_completed_object_in_created_at_order(open_disk, tmp_path):
    tier = await open_disk()
    batch = objects(30)
    for meta, blob in batch:
        await store(tier, meta, blob)
    abandoned = await tier.prepare_store(make_object(object_id_for(1, 5, 0))[0])
    await tier.write(abandoned, [make_object(object_id_for(1, 5, 0))[1]])
    await tier.close()  # the abandoned store's bytes are on disk, never indexed

    reopened = await open_disk()
    by_created = sorted(batch, key=lambda pair: pair[0].created_at_ns)
    assert [m async for m in reopened.iter_objects()] == [meta for meta, _ in by_created]
    for meta, blob in batch:
        assert await load(reopened, meta.object_id) == blob
    assert not await reopened.contains(object_id_for(1, 5, 0))
    assert reopened.stats().extra["recovery_dropped"] == 0


async def test_a_restart_drops_entries_whose_record_header_is_damaged(open_disk, tmp_path):
    tier = await open_disk(segment_bytes=1 << 20)
    batch = objects(5, size=2000)
    for meta, blob in batch:
        await store(tier, meta, blob)
    await tier.close()
    (first,) = [p for p in segment_files(tmp_path / "disk") if p.stat().st_size > 0]
    second = first.read_bytes().index(batch[1][0].object_id) - 16  # its record header
    with open(first, "r+b") as handle:  # the second record's header checksum
        handle.seek(second + 60)
        handle.write(b"\xff")

    reopened = await open_disk(segment_bytes=1 << 20)
    assert reopened.stats().extra["recovery_dropped"] == 1
    assert not await reopened.contains(batch[1][0].object_id)
    for meta, blob in batch[:1] + batch[2:]:
        assert await load(reopened, meta.object_id) == blob


# ---------------------------------------------------------------------------- eviction


async def test_eviction_takes_the_exact_lru_order_and_skips_leased_objects(open_disk):
    batch = objects(10, size=1000)
    size = batch[0][0].size
    tier = await open_disk(capacity=10 * size, high_watermark=0.8, low_watermark=0.5)
    for meta, blob in batch[:7]:
        await store(tier, meta, blob)
    assert await tier.evict(size) == []  # 8 of 10 is not above the high watermark
    lease = await tier.prepare_load(batch[1][0].object_id)  # 1 stays pinned
    for i in (2, 0, 3):
        await load(tier, batch[i][0].object_id)  # LRU order now 4 5 6 1 2 0 3

    evicted = await tier.evict(2 * size)  # 7 + 2 > 8: down to 5 - 2 = 3 objects

    assert [e.meta.object_id for e in evicted] == [batch[i][0].object_id for i in (4, 5, 6, 2)]
    assert [bytes(e.blob) for e in evicted] == [batch[i][1] for i in (4, 5, 6, 2)]
    assert tier.stats().evictions == 4 and tier.stats().bytes_used == 3 * size
    assert [m.object_id async for m in tier.iter_objects()] == [batch[i][0].object_id for i in (1, 0, 3)]
    await tier.complete_load(lease)


# ---------------------------------------------------------------------------- corruption, encryption


async def test_a_flipped_payload_byte_is_refused_and_the_object_dropped(open_disk, tmp_path):
    tier = await open_disk()
    (meta, blob), (other, other_blob) = objects(2, size=5000)
    await store(tier, meta, blob)
    await store(tier, other, other_blob)
    (segment,) = segment_files(tmp_path / "disk")
    with open(segment, "r+b") as handle:
        handle.seek(RECORD_HEADER_BYTES + meta.header_len + 1234)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))

    with pytest.raises(CorruptPayload):
        await load(tier, meta.object_id)
    with pytest.raises(NotFound):
        await tier.prepare_load(meta.object_id)
    assert tier.stats().extra["corrupt_dropped"] == 1
    assert await load(tier, other.object_id) == other_blob
    await tier.close()
    reopened = await open_disk()
    assert not await reopened.contains(meta.object_id)


async def test_read_into_lands_the_verified_object_in_the_callers_buffer_and_refuses_a_flipped_byte(
        open_disk, tmp_path):
    tier = await open_disk(segment_bytes=4 << 20)
    (meta, blob), (other, other_blob) = objects(2, size=300_000)  # past BUFFERED_BYTES: written by pwritev
    await store(tier, meta, blob)
    await store(tier, other, other_blob)
    dest = memoryview(bytearray(meta.size))
    lease = await tier.prepare_load(meta.object_id)
    assert (await tier.read(lease, into=dest)).obj is dest.obj
    await tier.complete_load(lease)
    assert bytes(dest) == blob

    (segment,) = segment_files(tmp_path / "disk")
    with open(segment, "r+b") as handle:  # one payload byte of the second record
        handle.seek(2 * RECORD_HEADER_BYTES + meta.size + other.header_len + 77_777)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x01]))
    lease = await tier.prepare_load(other.object_id)
    with pytest.raises(CorruptPayload):
        await tier.read(lease, into=memoryview(bytearray(other.size)))
    await tier.complete_load(lease)
    assert not await tier.contains(other.object_id)
    assert tier.stats().extra["corrupt_dropped"] == 1


async def test_a_lookup_reads_no_lmdb_transaction_per_object(open_disk):
    # find_by_key, prepare_load and read answer from memory and the segments: the index is
    # a checkpoint, so closing its environment changes nothing for them
    tier = await open_disk(checkpoint_ops=1 << 20, checkpoint_seconds=3600)
    stored = objects(3, size=5000)
    for meta, blob in stored:
        await store(tier, meta, blob)
    volume = tier._volume.state
    index, volume.index = volume.index, None
    try:
        for meta, blob in stored:
            assert await tier.find_by_key(meta.key_digest) == [meta]
            assert await load(tier, meta.object_id) == blob
    finally:
        volume.index = index


async def test_the_at_rest_cipher_keeps_payload_bytes_off_the_disk(open_disk, tmp_path):
    cipher = AtRestCipher.generate()
    tier = await open_disk(cipher=cipher)
    meta, blob = make_object(object_id_for(1, 0, 0), 8000)
    await store(tier, meta, blob)
    on_disk = b"".join(p.read_bytes() for p in segment_files(tmp_path / "disk"))
    assert blob[meta.header_len : meta.header_len + 64] not in on_disk
    assert blob[: meta.header_len] in on_disk  # the header stays readable (associated data)
    assert await load(tier, meta.object_id) == blob
    await tier.close()

    stranger = await open_disk(cipher=AtRestCipher.generate())  # a key this node never held
    with pytest.raises(CorruptPayload):
        await load(stranger, meta.object_id)
    assert not await stranger.contains(meta.object_id)


# ---------------------------------------------------------------------------- full filesystem


async def test_a_full_filesystem_gives_a_clean_capacity_error_and_loses_nothing(open_disk, tmp_path):
    directory = tmp_path / "disk"
    run = subprocess.run(module_command(WRITER, "fill", directory, 1 << 20), cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    stored = [bytes.fromhex(line.split()[1]) for line in lines if line.startswith("S ")]
    (full,) = [line.split() for line in lines if line.startswith("FULL ")]
    (deleted,) = [line.split() for line in lines if line.startswith("DELETED ")]
    assert full[2] == "CapacityError" and lines[-1] == "OK" and len(stored) >= 10
    assert deleted[1] == stored[0].hex() and int(deleted[2]) >= 1  # its COMMIT record did not fit
    stored = stored[1:]

    tier = await open_disk()
    assert tier.stats().extra["recovery_dropped"] == 0
    assert {m.object_id async for m in tier.iter_objects()} == set(stored)
    for object_id in stored:
        assert await load(tier, object_id) == make_object(object_id, 48 * 1024)[1]
    assert not await tier.contains(bytes.fromhex(full[1]))
    await store(tier, *make_object(bytes.fromhex(full[1]), 48 * 1024))  # room again: it fits now


# ---------------------------------------------------------------------------- the edge


def test_foreign_errors_become_statetier_errors_at_the_edge(tmp_path):
    index = DiskIndex.open(tmp_path / "index", map_size=64 * 1024)
    meta = make_object(object_id_for(1, 0, 0))[0]
    puts = [Put(IndexEntry(Location(1, i * 100, 100, 1), replace(meta, object_id=i.to_bytes(16, "little"))))
            for i in range(5000)]
    with pytest.raises(lmdb.MapFullError) as full:
        index.apply(puts)
    with pytest.raises(lmdb.Error) as bad_key:
        index.apply([Put(IndexEntry(Location(1, 0, 100, 1), replace(meta, object_id=b"")))])
    index.close()

    assert type(translate_error(full.value)) is CapacityError
    assert type(translate_error(bad_key.value)) is InternalError
    for code in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        assert type(translate_error(OSError(code, os.strerror(code)))) is CapacityError
    assert type(translate_error(OSError(errno.EIO, "I/O error"))) is Unavailable


@pytest.fixture
def small_filesystem(tmp_path):
    """A 4 MiB tmpfs (root only, as CI runs): a disk that really fills up."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


async def test_a_full_filesystem_refuses_stores_but_deletes_still_free_it(small_filesystem):
    tier = DiskTier(DiskTierOptions(small_filesystem / "disk", 64 << 20, segment_bytes=256 << 10), keyring=KEYRING)
    await tier.start()
    try:
        stored = []
        for i in range(200):  # bounded: 200 × 64 KiB is three times the filesystem
            meta, blob = make_object(object_id_for(7, 0, i), 64 << 10)
            try:
                await store(tier, meta, blob)
            except CapacityError:
                break
            stored.append(meta)
        else:
            pytest.fail("the filesystem never filled up")
        assert stored
        for meta in stored:  # every delete works: its COMMIT record has room
            assert await tier.delete(meta.object_id)
        await tier.compact()
        meta, blob = make_object(object_id_for(7, 1, 0), 64 << 10)
        await store(tier, meta, blob)  # and the room is back, without a restart
        assert await load(tier, meta.object_id) == blob
    finally:
        await tier.close()


async def test_one_eviction_reads_at_most_a_batch_into_memory_however_wide_the_watermark_band(open_disk):
    # Found by the load probe: a 2 GiB disk tier evicting down to its low watermark read
    # 300 MiB of victims into memory at once; the daemon's RSS passed its bound.
    tier = await open_disk(capacity=1 << 20, segment_bytes=256 << 10, eviction_batch_bytes=64 << 10)
    for meta, blob in objects(30, size=32 << 10):  # 30 × 32 KiB: past the 90 % high watermark
        await store(tier, meta, blob)
    evicted = await tier.evict(0)
    assert evicted and sum(e.meta.size for e in evicted) < (64 << 10) + (33 << 10)  # the band is 150 KiB
    assert tier.stats().bytes_used <= 0.9 * tier.capacity  # under the high watermark again
    await tier.evict(256 << 10)  # a store that needs more room gets all of it in one call
    assert tier.stats().bytes_used + (256 << 10) <= 0.9 * tier.capacity
