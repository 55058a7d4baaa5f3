"""The disk directory lock (``tiers.disk.dirlock``): one open tier per directory.

- A second tier on a directory an open tier holds refuses to start with ``ConfigError``
  naming the directory and the holder's pid, and touches nothing: the first tier's objects
  stay readable; once the first closes, the second starts and finds them.
- The lock dies with its holder: a process killed while holding it leaves no stale lock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from statetier.protocol.errors import ConfigError
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.disk.dirlock import DirectoryLock
from tests.support.disk_crash_writer import KEYRING, load, make_object, object_id_for, store


async def test_a_second_tier_on_a_held_directory_is_refused_naming_the_holder(tmp_path, open_disk) -> None:
    first = await open_disk()
    meta, blob = make_object(object_id_for(1, 1, 1))
    await store(first, meta, blob)
    second = DiskTier(DiskTierOptions(tmp_path / "disk", 64 << 20, segment_bytes=64 * 1024), keyring=KEYRING)
    with pytest.raises(ConfigError) as refused:
        await second.start()
    assert f"disk.directory {tmp_path / 'disk'} is in use by pid {os.getpid()}" in refused.value.message
    assert await load(first, meta.object_id) == blob
    await first.close()
    await second.start()
    try:
        assert await load(second, meta.object_id) == blob
    finally:
        await second.close()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from statetier.tiers.disk.dirlock import DirectoryLock
        DirectoryLock({str(tmp_path)!r}).acquire()
        print("held", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"in use by pid {holder.pid}"):
            DirectoryLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    assert (tmp_path / "lock").read_text() == f"{os.getpid()}\n"
    lock.release()
