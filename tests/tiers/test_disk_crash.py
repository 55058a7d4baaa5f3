"""Crash recovery of the disk tier: a writer process killed with SIGKILL at random moments.

``disk_crash_writer.py crash`` stores (three writers at once), deletes and compacts in one
directory and prints what has completed. The test kills it 15–25 times at random moments,
reusing the directory, then reopens the tier and checks the promises of a restart:

- every object whose store was reported complete is visible, unless a delete of it began;
- no object whose delete was reported complete is visible;
- every visible object is one the writer made and reads back verified, byte for byte;
- every index entry's record header was intact at every start (nothing was dropped);
- the index on disk, after a clean close, holds exactly the visible objects, each at a
  location inside its segment file.

Each writer life checkpoints its index at a different pace (after every op … never), so
most restarts rebuild part of the index from the COMMIT records in the segments.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import pytest

from statetier.tiers.disk.index import DiskIndex
from statetier.tiers.disk.segments import list_segments
from tests.support.disk_crash_writer import crash_size, load, make_object, object_id_for, open_tier
from tests.support.scripts import REPO, module_command

WRITER = "tests.support.disk_crash_writer"
BUDGET_SECONDS = 40


async def run_and_kill(directory: Path, seed: int, run: int, delay: float) -> tuple[int, int, list[bytes]]:
    """One writer life: start, let it work ``delay`` seconds, SIGKILL. Its complete lines."""
    proc = await asyncio.create_subprocess_exec(
        *module_command(WRITER, "crash", directory, seed, run), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        ready = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not ready.startswith(b"READY "):
            raise AssertionError(f"writer did not start: {ready!r} {await proc.stderr.read()!r}")
        await asyncio.sleep(delay)  # the behaviour under test: a kill at a random moment of its work
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        rest = await proc.stdout.read()
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL, await proc.stderr.read()
    _, dropped, replayed = ready.split()
    return int(dropped), int(replayed), rest.split(b"\n")[:-1]  # a line cut by the kill has no newline


@pytest.mark.timeout(120)
async def test_sigkill_at_random_moments_never_loses_or_tears_an_object(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    directory = tmp_path / "disk"
    completed, deleting, deleted = set(), set(), set()
    made: set[bytes] = set()
    started = time.monotonic()
    runs = rng.randrange(15, 26)
    replayed_total = 0
    for run in range(runs):
        if run >= 15 and time.monotonic() - started > BUDGET_SECONDS:
            break
        dropped, replayed, lines = await run_and_kill(directory, seed, run, rng.uniform(0.02, 0.3))
        assert dropped == 0, f"seed {seed} run {run}: recovery dropped {dropped} index entries"
        replayed_total += replayed
        stores = 0
        for line in lines:
            kind, object_id = line.split()[0], bytes.fromhex(line.split()[1].decode())
            {b"S": completed, b"d": deleting, b"D": deleted}[kind].add(object_id)
            stores += kind == b"S"
        made |= {object_id_for(seed, run, i) for i in range(stores + 3)}  # + the three in flight

    tier = open_tier(str(directory))
    await tier.start()
    try:
        assert tier.stats().extra["recovery_dropped"] == 0, f"seed {seed}"
        visible = {meta.object_id async for meta in tier.iter_objects()}
        assert completed - deleting <= visible, f"seed {seed}: completed objects lost"
        assert not deleted & visible, f"seed {seed}: deleted objects came back"
        assert visible <= made, f"seed {seed}: objects nobody wrote"
        for object_id in visible:
            assert await load(tier, object_id) == make_object(object_id, crash_size(object_id))[1], f"seed {seed}"
        assert len(completed) > 0
        assert replayed_total > 0, f"seed {seed}: no restart needed the log"  # the path under test
    finally:
        await tier.close()

    index = DiskIndex.open(directory / "index", map_size=64 << 20)
    try:
        entries, unreadable = index.scan()
    finally:
        index.close()
    sizes = list_segments(directory / "segments")
    assert unreadable == [] and {entry.meta.object_id for entry in entries} == visible, f"seed {seed}"
    for entry in entries:
        loc = entry.location
        assert loc.segment in sizes and loc.offset + loc.record_len <= sizes[loc.segment], f"seed {seed}"
