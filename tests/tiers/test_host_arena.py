"""The host tier's arena as other processes see it.

Another process given the fd maps the arena and reads a leased object's bytes at its
offset and fills a store in place (``complete_store`` with no ``write``); the memfd is
sealed against shrinking; the default arena leaves nothing in ``/dev/shm``; the
``/dev/shm`` fallback is unlinked at once; a named arena (``shm_dir``) is 0600 and locked
while its daemon lives, and the file a SIGKILLed daemon left is removed by the next start
(a live daemon's is not); pinning is off without CUDA and refused when demanded; ``close``
releases the arena while a view a caller still holds keeps the mapping alive.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from statetier.protocol.errors import ConfigError
from statetier.tiers.memory.host import HostTier, HostTierOptions, open_unlinked_shm
from tests.support.host_tier import MIB, tier  # noqa: F401  (a fixture, used by name)
from tests.support.tier_contract import load, make_object, store

_CHILD = """
import hashlib, mmap, sys
fd, size, read_at, read_len, write_at = map(int, sys.argv[1:6])
arena = mmap.mmap(fd, size)
print(hashlib.sha256(arena[read_at:read_at + read_len]).hexdigest())
payload = sys.stdin.buffer.read()
arena[write_at:write_at + len(payload)] = payload
"""


async def test_another_process_maps_the_arena_and_sees_and_fills_the_same_bytes(tier: HostTier) -> None:
    stored, stored_blob = make_object(300_000)
    await store(tier, stored, stored_blob)
    lease = await tier.prepare_load(stored.object_id, owner="client")
    offset = lease.location[0]
    incoming, incoming_blob = make_object(200_000)
    ticket = await tier.prepare_store(incoming)
    fd = tier.arena_fd
    args = [str(v) for v in (fd, tier.arena_size, offset, stored.size, ticket.location.offset)]
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", _CHILD, *args, pass_fds=[fd],
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    out, _ = await child.communicate(incoming_blob)
    assert child.returncode == 0
    assert out.decode().strip() == hashlib.sha256(stored_blob).hexdigest()
    await tier.complete_load(lease)
    await tier.complete_store(ticket, True)  # filled by the child, no write() here
    assert await load(tier, incoming.object_id) == incoming_blob


async def test_the_arena_cannot_be_shrunk_through_the_shared_fd(tier: HostTier) -> None:
    assert tier.is_memfd
    with pytest.raises(PermissionError):
        os.ftruncate(tier.arena_fd, 0)


async def test_the_default_arena_is_a_memfd_and_leaves_nothing_in_dev_shm() -> None:
    before = set(os.listdir("/dev/shm"))
    async with HostTier(HostTierOptions(1 * MIB, pin_memory=False)) as tier:
        assert tier.is_memfd
        assert os.readlink(f"/proc/self/fd/{tier.arena_fd}").startswith("/memfd:statetier-host")
        assert set(os.listdir("/dev/shm")) == before
    assert set(os.listdir("/dev/shm")) == before


_NAMED_ARENA_DAEMON = """
import asyncio, os, sys
from statetier.tiers.memory.host import HostTier, HostTierOptions

async def main(directory):
    tier = HostTier(HostTierOptions(1 << 20, shm_dir=directory, pin_memory=False))
    await tier.start()
    print(os.readlink(f"/proc/self/fd/{tier.arena_fd}"), flush=True)
    await asyncio.sleep(3600)  # the behaviour: a live daemon holding the arena, until the test kills it

asyncio.run(main(sys.argv[1]))
"""


def arena_path(tier: HostTier) -> Path:
    """The file behind the tier's arena descriptor (a named arena's path in ``shm_dir``)."""
    return Path(os.readlink(f"/proc/self/fd/{tier.arena_fd}"))


def start_named_arena_process(directory: Path) -> tuple[subprocess.Popen, Path]:
    """A process holding a named arena in ``directory`` (as a daemon with ``host.shm_dir``
    does); returns it and the arena's path once the arena exists."""
    proc = subprocess.Popen([sys.executable, "-c", _NAMED_ARENA_DAEMON, str(directory)], stdout=subprocess.PIPE,
                            text=True)
    return proc, Path(proc.stdout.readline().strip())


async def test_a_named_arena_is_private_to_the_daemon_and_removed_at_close(tmp_path: Path) -> None:
    async with HostTier(HostTierOptions(1 * MIB, shm_dir=tmp_path, pin_memory=False)) as tier:
        path = arena_path(tier)
        assert path.parent == tmp_path and not tier.is_memfd
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert list(tmp_path.iterdir()) == []


async def test_the_arena_a_sigkilled_daemon_left_is_removed_at_the_next_start_and_a_live_ones_kept(tmp_path: Path) -> None:
    dead, dead_arena = start_named_arena_process(tmp_path)
    live, live_arena = start_named_arena_process(tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert dead_arena.exists()  # SIGKILL runs no cleanup: the file stays behind...
        other = tmp_path / "not-an-arena.txt"
        other.write_text("left alone")
        async with HostTier(HostTierOptions(1 * MIB, shm_dir=tmp_path, pin_memory=False)) as tier:
            mine = arena_path(tier)
            # ...until the next daemon starts there: the dead one's goes, the live one's and
            # a file that is no arena stay
            assert sorted(tmp_path.iterdir()) == sorted([mine, live_arena, other])
    finally:
        live.kill()
        live.wait()


def test_the_dev_shm_fallback_is_unlinked_at_once() -> None:
    before = set(os.listdir("/dev/shm"))
    fd = open_unlinked_shm("statetier-test")
    try:
        assert set(os.listdir("/dev/shm")) == before
        os.ftruncate(fd, 8192)
        os.pwrite(fd, b"abc", 4096)
        assert os.pread(fd, 3, 4096) == b"abc"
    finally:
        os.close(fd)


async def test_pinning_is_off_without_cuda_and_refused_when_demanded() -> None:
    async with HostTier(HostTierOptions(1 * MIB)) as tier:
        assert not tier.is_pinned and tier.stats().extra["pinned"] is False
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: scripts/gpu_check.py covers pinning")
    with pytest.raises(ConfigError):
        await HostTier(HostTierOptions(1 * MIB, pin_memory=True)).start()


async def test_close_releases_the_arena_and_refuses_further_use() -> None:
    tier = HostTier(HostTierOptions(1 * MIB, pin_memory=False))
    await tier.start()
    meta, blob = make_object(1000)
    await store(tier, meta, blob)
    lease = await tier.prepare_load(meta.object_id)
    view = await tier.read(lease)
    kept = tier.arena_view  # a caller that holds a view keeps the mapping alive, safely
    await tier.close()
    await tier.close()
    with pytest.raises(ValueError):
        bytes(view)
    assert bytes(kept[: meta.size]) == blob
    with pytest.raises(RuntimeError):
        await tier.prepare_load(meta.object_id)
    with pytest.raises(RuntimeError):
        _ = tier.arena_fd
