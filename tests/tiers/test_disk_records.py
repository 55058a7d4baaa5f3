"""The disk tier's records are believed only when a holder of the keyring wrote them, where
they lie; a delete stays a delete whatever happens to its COMMIT record.

Someone who can write into the disk directory but holds no key (a process of another uid
that got the directory's group, a restored backup, a bad disk) can always destroy
records; what they must not do is make recovery *believe* something. Each test writes
what such a writer could, then restarts the tier:

- a forged COMMIT record deleting an object, in the format before records were
  authenticated (an unkeyed xxh3 checksum, what a restart used to accept) or under a key
  that is not the keyring's, planted where the walk resynchronises after a damaged header:
  skipped as damage, nothing it names is dropped;
- an authentic record copied to another offset does not read as a record there;
- the COMMIT record of an acknowledged delete damaged afterwards: the object stays deleted
  (the delete marked its record DELETED in the same fdatasync), whether or not the index
  checkpoint held the object;
- a segment file of record format 1 is set aside into ``segments/format-1/`` with a
  warning, never read and never silently dropped;
- a start with another keyring is refused (``ConfigError`` naming ``keys.keyring_file``) and
  changes nothing: the right keyring finds everything;
- the tier's directories are 0700 and its files 0600: a worker in the daemon's group (to
  reach the socket) reads none of it.
"""

from __future__ import annotations

import functools
import logging
import shutil
import stat
import struct
from pathlib import Path

import pytest
import xxhash

from statetier.protocol.errors import ConfigError
from statetier.protocol.keyring import dev_keyring
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.disk.index import Delete
from statetier.tiers.disk.log import encode_ops, encoded_len
from statetier.tiers.disk.records import RECORD_HEADER_BYTES
from tests.support.disk_crash_writer import load, make_object, object_id_for, store
from tests.support.disk_files import flip_bit, segment_file

NEVER = {"checkpoint_ops": 1 << 30, "checkpoint_seconds": 3600.0, "segment_bytes": 1 << 20}
FORGED_SEQ = 1_000_000  # newer than any checkpoint: a restart replays it if it believes it


@pytest.fixture
def open_disk(open_disk):
    """``conftest.open_disk``, one 1 MiB segment, checkpointing only at close."""
    return functools.partial(open_disk, **NEVER)


def objects(count: int, run: int, size: int = 3000):
    return [make_object(object_id_for(7, run, i), size) for i in range(count)]


async def visible(tier: DiskTier) -> set[bytes]:
    return {meta.object_id async for meta in tier.iter_objects()}


def the_segment(tmp_path: Path) -> Path:
    (segment,) = (tmp_path / "disk" / "segments").glob("seg-*.dat")
    return segment


def record_offset(segment: Path, object_id: bytes) -> int:
    return segment.read_bytes().index(object_id) - 16  # the object_id lies at 16 in a record header


def write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def format_1_commit(seq: int, ops) -> bytes:
    """A COMMIT record as statetier wrote them before records were authenticated (record
    format 1): anyone can compute its xxh3 checksums."""
    body = encode_ops(ops, encoded_len(ops))
    head = struct.pack("<4sBBHQ16sQQ8x", b"STRC", 1, 0x02, 0, len(body), bytes(16), seq,
                       xxhash.xxh3_64_intdigest(body))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + body


def format_1_object_record(object_id: bytes, blob: bytes) -> bytes:
    head = struct.pack("<4sBBHQ16sQQ8x", b"STRC", 1, 0, 0, len(blob), object_id, 1, 0)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + blob


def other_key_commit(segment: Path, offset: int, seq: int, ops) -> bytes:
    """A COMMIT record in today's format, authenticated under a key the daemon does not hold."""
    file = segment_file(segment, dev_keyring(b"not-the-daemons-key"))
    try:
        body = encode_ops(ops, encoded_len(ops))
        return file.commit_header(seq, body, offset) + body
    finally:
        file.close()


async def stored(open_disk, count: int, run: int, delete: int | None = None):
    tier = await open_disk()
    batch = objects(count, run)
    for meta, blob in batch:
        await store(tier, meta, blob)
    if delete is not None:
        assert await tier.delete(batch[delete][0].object_id)
    await tier.close()
    return batch


@pytest.mark.parametrize("forger", ["format-1 checksum", "another key"])
async def test_a_forged_delete_planted_after_a_damaged_header_is_skipped_as_damage(open_disk, tmp_path, forger):
    batch = await stored(open_disk, 8, run=1)
    segment = the_segment(tmp_path)
    damaged = record_offset(segment, batch[2][0].object_id)
    # the forged record inside the damaged record's body: where the walk resynchronises
    plant = damaged + RECORD_HEADER_BYTES + 256
    ops = [Delete(batch[5][0].object_id)]
    forged = (format_1_commit(FORGED_SEQ, ops) if forger == "format-1 checksum"
              else other_key_commit(segment, plant, FORGED_SEQ, ops))
    write_at(segment, plant, forged)
    flip_bit(segment, damaged + 8)  # batch[2]'s header: its length

    reopened = await open_disk()

    expected = dict(batch[:2] + batch[3:])  # batch[2] is damaged and gone; batch[5] is not
    assert await visible(reopened) == {meta.object_id for meta in expected}
    for meta, blob in expected.items():
        assert await load(reopened, meta.object_id) == blob


async def test_an_authentic_record_copied_to_another_offset_is_no_record_there(open_disk, tmp_path):
    batch = await stored(open_disk, 4, run=2, delete=1)
    segment = the_segment(tmp_path)
    data = segment.read_bytes()
    delete_commit = [offset for offset, header in segment_file(segment).walk() if header.is_commit][-1]
    record_len = len(data) - delete_commit  # the delete's COMMIT record is the last one
    copy = data[delete_commit : delete_commit + record_len]
    victim = record_offset(segment, batch[3][0].object_id)
    write_at(segment, victim + RECORD_HEADER_BYTES + 512, copy)  # replayed inside batch[3]'s body
    flip_bit(segment, victim + 8)

    file = segment_file(segment)
    try:
        walked = [offset for offset, header in file.walk() if header is not None and header.is_commit]
    finally:
        file.close()
    assert victim + RECORD_HEADER_BYTES + 512 not in walked


@pytest.mark.parametrize("checkpointed", [False, True], ids=["in the log only", "in the index checkpoint"])
async def test_a_deleted_object_stays_deleted_when_its_delete_commit_record_is_damaged(open_disk, tmp_path,
                                                                                       checkpointed):
    tier = await open_disk()
    batch = objects(6, run=3)
    for meta, blob in batch:
        await store(tier, meta, blob)
    if checkpointed:
        await tier.close()  # the index now holds batch[1]
        tier = await open_disk()
    saved = tmp_path / "index-before-the-delete"
    shutil.copytree(tmp_path / "disk" / "index", saved)
    assert await tier.delete(batch[1][0].object_id)  # acknowledged
    await tier.close()
    shutil.rmtree(tmp_path / "disk" / "index")  # the index as it was before the delete
    shutil.copytree(saved, tmp_path / "disk" / "index")
    segment = max((tmp_path / "disk" / "segments").glob("seg-*.dat"))  # where the delete was logged
    delete_commit = [offset for offset, header in segment_file(segment).walk() if header.is_commit][-1]
    flip_bit(segment, delete_commit + RECORD_HEADER_BYTES + 2)  # the delete's COMMIT record, later

    reopened = await open_disk()

    assert await visible(reopened) == {meta.object_id for meta, _ in batch} - {batch[1][0].object_id}
    assert reopened.stats().extra["recovery_dropped"] == 0


async def test_a_segment_of_record_format_1_is_set_aside_with_a_warning(open_disk, tmp_path, caplog):
    meta, blob = make_object(object_id_for(7, 4, 0), 3000)
    segments = tmp_path / "disk" / "segments"
    segments.mkdir(parents=True)
    old = segments / "seg-00000001.dat"
    old.write_bytes(format_1_object_record(meta.object_id, blob) + format_1_commit(1, []))

    with caplog.at_level(logging.WARNING, logger="statetier.tiers.disk"):
        tier = await open_disk()

    assert not old.exists() and (segments / "format-1" / old.name).read_bytes()[:4] == b"STRC"
    assert "record format 1" in caplog.text and "format-1" in caplog.text
    assert tier.stats().extra["recovery_legacy_segments"] == 1
    assert await visible(tier) == set()
    fresh, fresh_blob = make_object(object_id_for(7, 4, 1), 3000)
    await store(tier, fresh, fresh_blob)  # a new segment, numbered past the old one
    assert await load(tier, fresh.object_id) == fresh_blob
    assert sorted(p.name for p in segments.glob("seg-*.dat")) == ["seg-00000002.dat"]


async def test_the_tiers_directories_and_files_are_the_daemons_alone(open_disk, tmp_path):
    tier = await open_disk()
    for meta, blob in objects(3, run=5):
        await store(tier, meta, blob)
    await tier.close()
    root = tmp_path / "disk"
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path.relative_to(tmp_path)} is {mode:o}"


async def test_a_start_with_another_keyring_is_refused_and_changes_nothing(open_disk, tmp_path):
    batch = await stored(open_disk, 4, run=6)
    before = {p: p.read_bytes() for p in (tmp_path / "disk" / "segments").glob("seg-*.dat")}

    with pytest.raises(ConfigError, match="keys.keyring_file"):
        await DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, **NEVER),
                       keyring=dev_keyring(b"another-keyring")).start()

    assert {p: p.read_bytes() for p in (tmp_path / "disk" / "segments").glob("seg-*.dat")} == before
    reopened = await open_disk()  # the keyring that wrote them: everything is there
    assert await visible(reopened) == {meta.object_id for meta, _ in batch}
