"""Fixtures the tier tests share (the contract suite's own are in ``contract_fixtures.py``).

- ``started`` — ``await started(tier)`` starts ``tier`` and returns it; every tier started
  so is closed after the test, in order (a test may close and reopen one itself: ``close``
  twice is harmless).
- ``open_disk`` — ``await open_disk(**options)`` → a started ``DiskTier`` in
  ``tmp_path / "disk"`` (64 KiB segments, ``capacity`` 64 MiB unless given, the
  ``disk_crash_writer.KEYRING``); the same directory each call, so a second call reopens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from statetier.tiers.disk import DiskTier, DiskTierOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling disk_crash_writer.py
from disk_crash_writer import KEYRING  # noqa: E402


@pytest.fixture
async def started():
    opened = []

    async def start(tier):
        await tier.start()
        opened.append(tier)
        return tier

    yield start
    for tier in opened:
        await tier.close()


@pytest.fixture
def open_disk(tmp_path, started):
    def open_(**options):
        options.setdefault("segment_bytes", 64 * 1024)
        runtime = {name: options.pop(name) for name in ("cipher", "executor") if name in options}
        capacity = options.pop("capacity", 64 << 20)
        return started(DiskTier(DiskTierOptions(tmp_path / "disk", capacity, **options), keyring=KEYRING, **runtime))

    return open_
