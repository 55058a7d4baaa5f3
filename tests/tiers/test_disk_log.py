"""The disk tier's log: the segments carry every completed store and delete, the LMDB
index is only a checkpoint of them.

A power cut may take back the index's last transactions, and the unsynced tail of a
segment. Neither can be produced here, so each test makes the state a power cut would
leave behind — an index restored from an older snapshot, a segment torn in the middle of
a record — and checks that a restart rebuilds exactly the objects whose commits reached
the disk: no completed object lost, no deleted object back, nothing torn served.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

from statetier.tiers.disk import DiskTier
from statetier.tiers.disk.body import RecordBody
from statetier.tiers.disk.index import Delete, DiskIndex, IndexEntry, Location, Mark, Put
from statetier.tiers.disk.log import decode_ops, encode_ops, encoded_len
from statetier.tiers.disk.segments import RECORD_HEADER_BYTES
from tests.support.disk_crash_writer import KEYRING, load, make_object, object_id_for, store
from tests.support.disk_files import flip_bit, segment_file

NEVER = {"checkpoint_ops": 1 << 30, "checkpoint_seconds": 3600.0}  # only close checkpoints


def objects(count: int, run: int, size: int = 3000):
    return [make_object(object_id_for(3, run, i), size) for i in range(count)]


@pytest.fixture
def open_disk(open_disk):
    """``conftest.open_disk``, checkpointing only at close."""
    return functools.partial(open_disk, **NEVER)


def snapshot_index(tmp_path: Path) -> Path:
    saved = tmp_path / "index-snapshot"
    shutil.copytree(tmp_path / "disk" / "index", saved)
    return saved


def restore_index(tmp_path: Path, saved: Path) -> None:
    shutil.rmtree(tmp_path / "disk" / "index")
    shutil.copytree(saved, tmp_path / "disk" / "index")


async def visible(tier: DiskTier) -> set[bytes]:
    return {meta.object_id async for meta in tier.iter_objects()}


async def test_an_index_that_lost_its_last_transactions_is_rebuilt_from_the_log(open_disk, tmp_path):
    tier = await open_disk()
    first = objects(10, run=0)
    for meta, blob in first:
        await store(tier, meta, blob)
    await tier.close()
    saved = snapshot_index(tmp_path)  # the last checkpoint a power cut would leave

    tier = await open_disk()
    second = objects(20, run=1)
    for meta, blob in second:
        await store(tier, meta, blob)
    deleted = [first[0], first[3], second[2], second[7]]
    for meta, _ in deleted:
        assert await tier.delete(meta.object_id)
    await tier.close()
    restore_index(tmp_path, saved)

    reopened = await open_disk()

    expected = {meta.object_id: blob for meta, blob in first + second}
    for meta, _ in deleted:
        del expected[meta.object_id]
    assert await visible(reopened) == set(expected)
    extra = reopened.stats().extra
    assert (extra["recovery_replayed"], extra["recovery_dropped"], extra["recovery_unverified"]) == (18 + 2, 0, 0)
    for object_id, blob in expected.items():
        assert await load(reopened, object_id) == blob
    meta = second[0][0]
    assert await reopened.find_by_key(meta.key_digest) == [meta]
    await reopened.close()

    again = await open_disk()  # the rebuilt index was checkpointed: nothing left to replay
    assert await visible(again) == set(expected)
    assert again.stats().extra["recovery_replayed"] == 0


async def test_even_an_index_older_than_a_compaction_gets_the_moves_back_from_the_log(open_disk, tmp_path):
    tier = await open_disk(segment_bytes=16 * 1024)
    batch = objects(24, run=0)
    for meta, blob in batch:
        await store(tier, meta, blob)
    await tier.close()
    saved = snapshot_index(tmp_path)

    tier = await open_disk(segment_bytes=16 * 1024)
    for meta, _ in batch[::2]:
        await tier.delete(meta.object_id)
    report = await tier.compact()
    assert report.objects_moved > 0 and report.segments_compacted > 0
    await tier.close()
    restore_index(tmp_path, saved)  # older than the checkpoint compaction forced (no power cut does that)

    reopened = await open_disk(segment_bytes=16 * 1024)

    kept = dict(batch[1::2])
    assert await visible(reopened) == {meta.object_id for meta in kept}
    for meta, blob in kept.items():
        assert await load(reopened, meta.object_id) == blob


async def test_a_torn_segment_tail_keeps_exactly_the_commits_before_the_tear(open_disk, tmp_path):
    tier = await open_disk(segment_bytes=1 << 20)
    first = objects(5, run=0)
    for meta, blob in first:
        await store(tier, meta, blob)
    await tier.close()
    saved = snapshot_index(tmp_path)

    tier = await open_disk(segment_bytes=1 << 20)
    second = objects(8, run=1)
    for meta, blob in second:  # one at a time: each record, then its own COMMIT record
        await store(tier, meta, blob)
    await tier.close()
    restore_index(tmp_path, saved)
    segment = segment_holding(tmp_path, second[0][0].object_id)
    tear = segment.read_bytes().index(second[5][0].object_id) - 16  # the sixth record's header
    with open(segment, "r+b") as handle:
        handle.truncate(tear + RECORD_HEADER_BYTES + 100)

    reopened = await open_disk(segment_bytes=1 << 20)

    expected = dict(first + second[:5])
    assert await visible(reopened) == {meta.object_id for meta in expected}
    assert reopened.stats().extra["recovery_replayed"] == 5
    for meta, blob in expected.items():
        assert await load(reopened, meta.object_id) == blob
    await store(reopened, *second[5])  # the tier goes on in a fresh segment
    await reopened.close()
    again = await open_disk(segment_bytes=1 << 20)
    assert await visible(again) == {meta.object_id for meta in expected} | {second[5][0].object_id}


def segment_holding(tmp_path: Path, object_id: bytes) -> Path:
    (segment,) = [p for p in (tmp_path / "disk" / "segments").glob("seg-*.dat") if object_id in p.read_bytes()]
    return segment


def records_of(segment: Path) -> list[tuple[int, object]]:
    file = segment_file(segment)
    try:
        return list(file.walk())
    finally:
        file.close()


async def stored_after_a_checkpoint(open_disk, tmp_path, count: int, run: int = 4, deleted: int | None = None):
    """``count`` objects of ``run`` stored one at a time (a record, then its COMMIT record),
    then the ``deleted``-th of them deleted, all of which only the log knows of: the index is
    put back to the checkpoint before them. The objects, and the segment holding them."""
    tier = await open_disk(segment_bytes=1 << 20)
    await tier.close()
    saved = snapshot_index(tmp_path)
    tier = await open_disk(segment_bytes=1 << 20)
    batch = objects(count, run=run)
    for meta, blob in batch:
        await store(tier, meta, blob)
    if deleted is not None:
        assert await tier.delete(batch[deleted][0].object_id)
    await tier.close()
    restore_index(tmp_path, saved)
    return batch, segment_holding(tmp_path, batch[0][0].object_id)


@pytest.mark.parametrize("field_offset", [0, 8, 20, 33, 42, 60])  # magic, length, object_id, generation, key id, MAC
async def test_a_flipped_bit_in_one_record_header_loses_only_that_object(open_disk, tmp_path, field_offset):
    batch, segment = await stored_after_a_checkpoint(open_disk, tmp_path, 8)
    victim = segment.read_bytes().index(batch[2][0].object_id) - 16
    flip_bit(segment, victim + field_offset)

    reopened = await open_disk(segment_bytes=1 << 20)

    expected = dict(batch[:2] + batch[3:])
    assert await visible(reopened) == {meta.object_id for meta in expected}
    for meta, blob in expected.items():
        assert await load(reopened, meta.object_id) == blob
    assert reopened.stats().extra["recovery_unverified"] == 1  # its COMMIT names a record not there


@pytest.mark.parametrize("where", ["header", "body"])
async def test_a_flipped_bit_in_a_commit_record_keeps_the_intact_objects_it_named(open_disk, tmp_path, where):
    batch, segment = await stored_after_a_checkpoint(open_disk, tmp_path, 8)
    commits = [offset for offset, header in records_of(segment) if header.is_commit]
    assert len(commits) == 8
    flip_bit(segment, commits[3] + (40 if where == "header" else RECORD_HEADER_BYTES + 2))

    reopened = await open_disk(segment_bytes=1 << 20)

    assert await visible(reopened) == {meta.object_id for meta, _ in batch}
    for meta, blob in batch:
        assert await load(reopened, meta.object_id) == blob
    assert reopened.stats().extra["recovery_adopted"] == 1
    assert await reopened.find_by_key(batch[3][0].key_digest) == [batch[3][0]]
    await reopened.close()
    again = await open_disk(segment_bytes=1 << 20)  # adopted into the checkpoint, for good
    assert await visible(again) == {meta.object_id for meta, _ in batch}


async def test_a_record_after_the_last_commit_record_is_a_torn_tail_never_adopted(open_disk, tmp_path):
    batch, segment = await stored_after_a_checkpoint(open_disk, tmp_path, 4)
    extra_meta, extra_blob = make_object(object_id_for(4, 9, 0), 3000)
    size = segment.stat().st_size
    file = segment_file(segment)
    try:  # a reservation a kill left without its header, then a store no COMMIT record names
        RecordBody(KEYRING, None).write_record(file, size + 4096, extra_meta.object_id, extra_meta.size,
                                               [memoryview(extra_blob)])
    finally:
        file.close()

    reopened = await open_disk(segment_bytes=1 << 20)

    assert await visible(reopened) == {meta.object_id for meta, _ in batch}
    assert reopened.stats().extra["recovery_adopted"] == 0


async def test_a_compaction_copy_no_commit_names_is_never_adopted(open_disk, tmp_path):
    # A copy whose move had no effect (its object was deleted meanwhile) is a record no
    # COMMIT names: after a crash with damage in its segment it must not bring the object back.
    batch, segment = await stored_after_a_checkpoint(open_disk, tmp_path, 8)
    records = records_of(segment)
    commits = [offset for offset, header in records if header.is_commit]
    flip_bit(segment, commits[3] + RECORD_HEADER_BYTES + 2)  # the COMMIT naming batch[3]
    (offset, header), = [(o, h) for o, h in records if h.is_object and h.object_id == batch[3][0].object_id]
    file = segment_file(segment)
    try:  # its record, as a compaction copy would have written it
        file.write_at(offset, [file.header_bytes(header.moved(), offset)])
    finally:
        file.close()

    reopened = await open_disk(segment_bytes=1 << 20)

    assert await visible(reopened) == {meta.object_id for meta, _ in batch} - {batch[3][0].object_id}
    assert reopened.stats().extra["recovery_adopted"] == 0


async def test_a_commit_record_lost_to_damage_brings_back_no_object_a_later_commit_deleted(open_disk, tmp_path):
    batch, segment = await stored_after_a_checkpoint(open_disk, tmp_path, 6, run=5, deleted=1)
    commits = [offset for offset, header in records_of(segment) if header.is_commit]
    flip_bit(segment, commits[1] + RECORD_HEADER_BYTES + 2)  # the COMMIT of batch[1]'s put

    reopened = await open_disk(segment_bytes=1 << 20)

    assert await visible(reopened) == {meta.object_id for meta, _ in batch} - {batch[1][0].object_id}


async def test_a_commit_whose_record_does_not_verify_is_not_indexed(open_disk, tmp_path):
    batch, segment = await stored_after_a_checkpoint(open_disk, tmp_path, 3, run=0)
    victim = segment.read_bytes().index(batch[1][0].object_id) - 16
    with open(segment, "r+b") as handle:  # a payload byte the fdatasync never got to
        handle.seek(victim + RECORD_HEADER_BYTES + batch[1][0].header_len + 10)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0x40]))

    reopened = await open_disk(segment_bytes=1 << 20)

    assert await visible(reopened) == {batch[0][0].object_id, batch[2][0].object_id}
    extra = reopened.stats().extra
    assert (extra["recovery_replayed"], extra["recovery_unverified"]) == (2, 1)


def test_a_commit_body_lists_puts_and_deletes_in_order():
    meta = make_object(object_id_for(3, 9, 0))[0]
    ops = [Put(IndexEntry(Location(4, 128, RECORD_HEADER_BYTES + meta.size, 2), meta)), Delete(b"\x07" * 16)]
    body = encode_ops(ops, encoded_len(ops) + 40)
    assert len(body) == encoded_len(ops) + 40 and body.endswith(bytes(40))
    assert decode_ops(body) == ops
    with pytest.raises(ValueError):
        encode_ops(ops, encoded_len(ops) - 1)


def test_an_index_checkpoint_records_how_far_it_reaches(tmp_path):
    index = DiskIndex.open(tmp_path / "index", map_size=1 << 20)
    try:
        assert (index.mark().last_seq, index.mark().scan_from) == (0, 1)
        meta = make_object(object_id_for(3, 9, 1))[0]
        index.checkpoint([Put(IndexEntry(Location(2, 0, RECORD_HEADER_BYTES + meta.size, 1), meta))], Mark(17, 3))
        assert index.mark() == Mark(17, 3)
        entries, unreadable = index.scan()
        assert [e.meta for e in entries] == [meta] and unreadable == []
    finally:
        index.close()
