"""One owner per disk directory: an exclusive lock held from the tier's start to its close.

``DirectoryLock(directory)`` — ``acquire()`` takes ``flock(LOCK_EX | LOCK_NB)`` on
``directory/lock`` and writes the owner's pid into it; a directory that another open tier
holds (another daemon, or another tier of this process) raises ``ConfigError("disk.directory
… is in use by pid N")``. ``release()`` closes the file, which drops the lock; the kernel
drops it too when the owner dies, so a killed daemon never leaves a stale lock behind
(the pid left in the file is only read to name the holder of a lock that is held).

Two daemons appending to one directory's segments overwrite each other's records: the
``DiskTier`` takes this lock before it reads or writes anything there.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from statetier.protocol.errors import ConfigError

LOCK_FILE = "lock"


class DirectoryLock:
    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Blocking (a few syscalls; the tier runs it in its executor)."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise ConfigError(f"disk.directory {self.path.parent} is in use by {who} (its lock file {self.path}); "
                              f"give each daemon a directory of its own") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
