"""The host tier: one arena in memory only the daemon maps (same-host clients get windows of
their own, ``daemon/server/windows.py``; none of them opens or maps the arena).

- ``HostTier(HostTierOptions(capacity_bytes, shm_dir=None, pin_memory=None, …), executor=None)``
  — an ``ExtentTier`` whose medium is a ``HostArena``: an anonymous ``memfd`` (the default:
  nothing in any directory another process could open; a ``/dev/shm`` file unlinked right
  after open where memfd is missing), or, with ``shm_dir``, a named arena file there: mode
  0600, owned by the daemon, held under an exclusive ``flock`` while the daemon lives and
  removed at ``close()``; arena files a dead daemon left in ``shm_dir`` (their lock free)
  are removed at ``start()`` (``remove_dead_arenas``). Sized with ``ftruncate`` and
  ``mmap``'d once at ``start()``.
- ``arena_fd`` / ``arena_size`` / ``arena_view`` — the arena's descriptor and a writable
  view of it, for the daemon's own copies (and tests); no client is given either.
  ``StoreTicket.location`` is the ``PendingStore`` (its arena offset) of a store in progress and
  ``Lease.location`` is ``(offset, generation)``: the daemon fills ``ticket.view`` in place
  and calls ``complete_store`` with no ``write()`` at all.
- ``read(lease)`` is a read-only view of the arena, no copy, valid until ``complete_load``.
- ``compact()`` (from ``ExtentTier``) defragments the arena around leased objects.
- Its bytes move with ``HostBytes`` (``tiers.memory.hostbytes``).
- ``populate=True``: the arena is faulted in at start on a thread of its own
  (``tiers.memory.populate``), so a fresh put does not fault; ``arena.population``.

With CUDA present (``pin_memory=None``) or asked for (``True``) the arena is registered as
pinned memory (``cudaHostRegister``), so device copies from and to it are true DMA; torch
is imported only then. The memfd is sealed against shrinking and growing, so nothing that
ever holds its fd can truncate the arena under the daemon (which would fault on the next
access).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import sys
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from statetier.protocol.errors import CapacityError, ConfigError, InternalError, StatetierError, Unavailable

from ..base import TierStats
from .extent import ExtentTier, ExtentTierOptions
from .hostbytes import HostBytes
from .pins import PinnedJobs
from .populate import Population
from .rawmemory import address_of, release_quietly

_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
#: ``statetier-<tier name>-<pid>-<random>.arena``: the name of a named arena file.
_ARENA_NAME = re.compile(r"^statetier-[A-Za-z0-9_.-]+-\d+-[0-9a-f]+\.arena$")

log = logging.getLogger("statetier.tiers.host")


def open_memfd(name: str) -> int:
    """An anonymous shared-memory file that can be sealed; ``OSError`` where unsupported."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    return os.memfd_create(name, flags)


def open_unlinked_shm(name: str, directory: str = "/dev/shm") -> int:
    """A file in ``directory`` that is unlinked as soon as it is open: only the fd names it."""
    path = os.path.join(directory, f"{name}-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.unlink(path)
    return fd


def remove_dead_arenas(directory: str) -> list[str]:
    """Remove the named arena files in ``directory`` whose daemon is gone: files of this uid
    named like an arena whose ``flock`` is free (a live daemon holds its own for as long as
    it runs; the kernel drops it when the process dies, however it died). Returns the paths
    removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not _ARENA_NAME.match(name):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # another user's, or gone already
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live daemon's arena
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d arena file(s) a dead daemon left in %s: %s", len(removed), directory,
                    ", ".join(os.path.basename(p) for p in removed))
    return removed


@dataclass(frozen=True, slots=True)
class HostTierOptions(ExtentTierOptions):
    """``ExtentTierOptions`` and where the arena lives: ``shm_dir`` (a named file there, mode
    0600) or None (a memfd); ``pin_memory``: None registers it with CUDA when CUDA is there."""

    name: str = "host"
    pin_memory: bool | None = None
    shm_dir: str | os.PathLike[str] | None = None
    populate: bool = False  # fault the whole arena in at start, on a thread (``populate.Population``)


class HostArena:
    """The host tier's medium (an ``ExtentMedium``): the arena file, its mapping, its CUDA
    registration. See the module docstring."""

    def __init__(self, config: HostTierOptions) -> None:
        self.name = config.name
        self.capacity = config.capacity_bytes
        self._pin_memory = config.pin_memory
        self._shm_dir = None if config.shm_dir is None else os.fspath(config.shm_dir)
        self._shm_path: str | None = None
        self.fd = -1
        self._mmap: mmap.mmap | None = None
        self.region: memoryview | None = None
        self._address = 0
        self._cudart: Any = None
        self.is_memfd = False
        self._populate = config.populate
        self.population = Population(config.name)

    @property
    def is_pinned(self) -> bool:
        return self._cudart is not None

    def movers(self, jobs: PinnedJobs, inline_copy_bytes: int) -> HostBytes:
        assert self.region is not None, "movers of an arena that is not open"
        return HostBytes(self.region, self._address, jobs, inline_copy_bytes)

    def translate(self, exc: Exception) -> StatetierError:
        return InternalError(f"{self.name}: copy failed: {exc}")

    def open(self) -> None:
        fd = self._open_fd()
        try:
            self._size_arena(fd)
            arena = mmap.mmap(fd, self.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            if self._shm_path is not None:
                os.unlink(self._shm_path)
                self._shm_path = None
            raise CapacityError(f"{self.name}: cannot create a {self.capacity}-byte arena: {exc}") from exc
        self.fd, self._mmap = fd, arena
        self.region = memoryview(arena)
        self._address = address_of(arena)
        try:
            if self._should_pin():
                self._register_pinned()
        except BaseException:
            self.close()
            raise
        if self._populate:
            self.population.start(self._address, self.capacity)

    def _open_fd(self) -> int:
        label = f"statetier-{self.name}"
        if self._shm_dir is not None:
            return self._open_named(label)
        try:
            fd = open_memfd(label)
            self.is_memfd = True
            return fd
        except (AttributeError, OSError):
            pass
        try:
            return open_unlinked_shm(label)
        except OSError as exc:
            raise Unavailable(f"{self.name}: neither memfd nor /dev/shm is usable: {exc}") from exc

    def _open_named(self, label: str) -> int:
        """The arena as a named file in ``shm_dir`` (when an operator wants to see it there):
        mode 0600, so only the daemon's own uid can open it; locked (``flock``) while the
        daemon lives, so the next start can tell a dead daemon's file from a live one's and
        removes it (``remove_dead_arenas``); removed again at ``close()``."""
        assert self._shm_dir is not None
        remove_dead_arenas(self._shm_dir)
        path = os.path.join(self._shm_dir, f"{label}-{os.getpid()}-{secrets.token_hex(6)}.arena")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise Unavailable(f"{self.name}: cannot create the arena file in {self._shm_dir}: {exc}") from exc
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise Unavailable(f"{self.name}: cannot lock the arena file {path}: {exc}") from exc
        self._shm_path = path
        return fd

    def _size_arena(self, fd: int) -> None:
        os.ftruncate(fd, self.capacity)
        if self.is_memfd:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        else:
            # tmpfs may be size-limited (64 MiB in a default container): fail here, not
            # with SIGBUS on first touch of a page the filesystem cannot back.
            os.posix_fallocate(fd, 0, self.capacity)

    def _should_pin(self) -> bool:
        if self._pin_memory is False:
            return False
        if self._pin_memory is None and "torch" not in sys.modules:
            if not any(os.path.exists(node) for node in _GPU_DEVICE_NODES):
                return False  # no GPU here: do not pay for importing torch
        try:
            import torch
        except ImportError as exc:
            if self._pin_memory:
                raise ConfigError(f"{self.name}: pin_memory=True needs torch with CUDA") from exc
            return False
        if not torch.cuda.is_available():
            if self._pin_memory:
                raise ConfigError(f"{self.name}: pin_memory=True but CUDA is not available")
            return False
        return True

    def _register_pinned(self) -> None:
        import torch

        cudart = torch.cuda.cudart()
        status = int(cudart.cudaHostRegister(self._address, self.capacity, 0))
        if status == 0:
            self._cudart = cudart
        elif self._pin_memory:
            raise Unavailable(f"{self.name}: cudaHostRegister of the arena failed (cudaError {status})")

    def close(self) -> None:
        self.population.stop()  # before the mapping goes
        if self._cudart is not None:
            self._cudart.cudaHostUnregister(self._address)
            self._cudart = None
        release_quietly(self.region)
        self.region, self._address = None, 0
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a caller still holds a view: the mapping goes when the last view does
            self._mmap = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._shm_path is not None:
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass
            self._shm_path = None



class HostTier(ExtentTier):
    """Shared-memory arena tier. See the module docstring."""

    def __init__(self, config: HostTierOptions, executor: Executor | None = None) -> None:
        self._arena = HostArena(config)
        super().__init__(config, self._arena, executor, offers_store_view=True)

    # ------------------------------------------------------------------ the arena, for the daemon

    @property
    def arena_fd(self) -> int:
        self._region.require_open()
        return self._arena.fd

    @property
    def arena_size(self) -> int:
        return self.capacity

    @property
    def arena_view(self) -> memoryview:
        """A writable view of the whole arena (a fresh one each time: releasing it is harmless)."""
        self._region.require_open()
        assert self._arena.region is not None
        return self._arena.region[:]

    @property
    def is_pinned(self) -> bool:
        return self._arena.is_pinned

    @property
    def is_memfd(self) -> bool:
        return self._arena.is_memfd

    def stats(self) -> TierStats:
        stats = super().stats()
        stats.extra.update({"pinned": self.is_pinned, "memfd": self.is_memfd})
        return stats
