"""What the end-to-end tests share about daemons: a fixture and a look into a daemon's arena.

The daemon process itself is ``statetier.launch.DaemonProcess`` (also used by the
benchmarks, the examples and the reliability harness); this module adds what only tests want:

- ``daemon_fixture(request, **kw)`` — start one; at teardown SIGTERM it, print its log tail
  (pytest shows it only when the test failed), close it and assert it exited with 0.
- ``arena_copy(pid, state_id)`` — a ``with`` block over the daemon's own host arena, mapped
  writable through ``/proc/<pid>/fd`` (what only a daemon bug or root could do: no client
  maps it), giving ``(arena, offset, length)`` of the object's copy (signed header + payload).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager

from statetier.launch.daemons import DaemonProcess


def daemon_fixture(request, **kwargs) -> DaemonProcess:
    """Start a daemon for a fixture. At teardown: SIGTERM, print the log tail (pytest shows it
    only for a failed test), remove its directory, and assert that it exited with 0."""
    daemon = DaemonProcess(**kwargs)
    served = False

    def finish() -> None:
        code = None
        try:
            if served:
                code = daemon.stop() if daemon.is_running else daemon.proc.returncode
        finally:
            print(f"--- log tail of the daemon in {daemon.directory}:\n{daemon.log_tail()}")
            daemon.close()
        assert not served or code == 0, f"the daemon exited with {code}"

    request.addfinalizer(finish)
    daemon.start()
    served = True
    return daemon


@contextmanager
def arena_copy(pid: int, state_id: bytes) -> Iterator[tuple[mmap.mmap, int, int]]:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if "statetier-host" not in os.readlink(path):
                continue
        except OSError:
            continue
        with open(path, "r+b") as handle, mmap.mmap(handle.fileno(), 0) as arena:
            at = arena.find(b"STSO")
            while at >= 0:
                if arena[at + 136 : at + 152] == state_id:  # state_id in the header (protocol.md §1.1)
                    header_len = int.from_bytes(arena[at + 8 : at + 12], "little")
                    payload_len = int.from_bytes(arena[at + 16 : at + 24], "little")
                    yield arena, at, header_len + payload_len
                    return
                at = arena.find(b"STSO", at + 1)
    raise AssertionError(f"no arena copy of {state_id.hex()} in daemon {pid}")
