"""What the disk tier tests read and damage of the files a disk tier wrote.

- ``objects(count, size, run)`` — the sealed objects ``disk_crash_writer`` derives for run
  ``run`` (seed 1), with their metadata.
- ``segment_files(directory)`` — a tier directory's segment files, in order;
  ``segment_file(path, keyring)`` — one opened as a ``SegmentFile`` (records authenticated
  under ``keyring``).
- ``flip_bit(path, offset, bit)`` — one bit of a file flipped in place.
"""

from __future__ import annotations

from pathlib import Path

from statetier.tiers.disk.records import RecordCodec
from statetier.tiers.disk.segments import SegmentFile
from tests.support.disk_crash_writer import KEYRING, make_object, object_id_for


def objects(count: int, size: int | None = None, run: int = 0):
    return [make_object(object_id_for(1, run, i), size) for i in range(count)]


def segment_files(directory: Path) -> list[Path]:
    return sorted((directory / "segments").glob("seg-*.dat"))


def segment_file(segment: Path, keyring=KEYRING) -> SegmentFile:
    """The segment file at ``segment``, its records authenticated under ``keyring``."""
    return SegmentFile(segment.parent, int(segment.stem.split("-")[1]), RecordCodec(keyring))


def flip_bit(path: Path, offset: int, bit: int = 0x10) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ bit]))
