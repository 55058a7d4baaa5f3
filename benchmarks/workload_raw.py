"""The raw limits the serving workloads are measured against, timed in the same run.

- ``byte_views(tensors)`` — the bytes of CPU tensors as flat ``memoryview`` s (no copy).
- ``MemoryRaw(views)`` — ``run()``: copy every view into a preallocated buffer and take
  its keyed BLAKE3, one thread: what sealing on put or verifying on load costs at least.
- ``FileRaw(directory)`` — ``write_sync(views)``: ``pwrite`` + ``fdatasync`` of each view
  at growing offsets of one file (as the disk tier appends), then the file is truncated.
- ``ReadRaw(directory)`` — ``stage(views)`` writes the views to one file (fdatasync'd, not
  timed); ``run_warm()`` / ``run_cold()``: ``pread`` each back into a preallocated buffer and
  take its keyed BLAKE3, with the file's pages in the page cache, or dropped first
  (``POSIX_FADV_DONTNEED``): what a verified load from the disk tier costs at least.
- ``RedisRaw(url, connections=1)`` — async; ``set_all(views)`` / ``get_all()``: redis-py
  with hiredis, each view split into the Redis tier's 2 MiB chunks, one pipeline per view;
  ``clear()``. With ``connections=N > 1`` the best redis-py does on the same bytes: every
  chunk of every view at once, split into N pipelines sent concurrently on N connections
  (``BEST_CONNECTIONS``, named ``BEST_NAME``).
- ``timed(fn)`` / ``atimed(coro_fn)`` — seconds one call took.
- ``paired_row(suite, tier, op, size, batch, measured, raw, raw_times, **extra)`` — one JSON
  row: GB/s of the median time of each side, ``ratio`` the median of per-repetition ratios
  (raw time ÷ measured time), p50 / p99 of the measured times.
- ``limits(redis_url, directory, seconds)`` — async; the 2 MiB raw limits (memcpy+BLAKE3,
  write+fdatasync, SET, GET) as ``{name: GB/s}``, the best call over about ``seconds``.

Every raw path moves the same bytes as the statetier path it is paired with; none seals,
verifies a header, or crosses a process boundary the way statetier does.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import blake3

from .rows import percentile
from statetier.protocol.keyring import Keyring

MiB = 1024 * 1024
CHUNK_BYTES = 2 * MiB  # the Redis tier's default chunk size (redis.chunk_bytes)
DIGEST_KEY = Keyring.generate().active.digest_key  # a fresh key: the same cost as the daemon's


def byte_views(tensors) -> list[memoryview]:
    import torch

    return [memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B") for t in tensors]


def paired_row(suite: str, tier: str, op: str, size: int, batch: int, measured: list[float], raw: str,
               raw_times: list[float], **extra) -> dict:
    """``measured[i]`` and ``raw_times[i]`` moved ``size`` bytes in the same repetition ``i``."""
    t, t_raw = statistics.median(measured), statistics.median(raw_times)
    return {"suite": suite, "tier": tier, "op": op, "size_bytes": int(size), "batch": int(batch),
            "gbps": size / t / 1e9, "raw": raw, "raw_gbps": size / t_raw / 1e9,
            "ratio": statistics.median(r / m for r, m in zip(raw_times, measured)),
            "p50_us": t * 1e6, "p99_us": percentile(measured, 99) * 1e6, "raw_p50_us": t_raw * 1e6,
            "raw_p99_us": percentile(raw_times, 99) * 1e6, "samples": len(measured), "metric": "throughput",
            **extra}


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


async def atimed(fn) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


class MemoryRaw:
    """Copy + keyed BLAKE3 of each view into buffers allocated (and faulted in) up front."""

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.targets = [memoryview(bytearray(len(v))) for v in views]
        for src, dst in zip(views, self.targets):
            dst[:] = src

    def run(self) -> None:
        for src, dst in zip(self.views, self.targets):
            dst[:] = src
            blake3.blake3(dst, key=DIGEST_KEY).digest()


class FileRaw:
    """``pwrite`` + ``fdatasync`` per view into one file under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / f"raw-{os.getpid()}.dat"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def write_sync(self, views: list[memoryview]) -> None:
        offset = 0
        for view in views:
            os.pwrite(self.fd, view, offset)
            os.fdatasync(self.fd)
            offset += len(view)

    def reset(self) -> None:
        os.ftruncate(self.fd, 0)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


class ReadRaw:
    """``pread`` + keyed BLAKE3 of staged bytes, page cache warm or cold."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / f"raw-read-{os.getpid()}.dat"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.extents: list[tuple[int, int]] = []
        self.targets: list[memoryview] = []

    def stage(self, views: list[memoryview]) -> None:
        os.ftruncate(self.fd, 0)
        self.extents, offset = [], 0
        for view in views:
            os.pwrite(self.fd, view, offset)
            self.extents.append((offset, len(view)))
            offset += len(view)
        os.fdatasync(self.fd)  # clean pages: DONTNEED can drop them
        self.targets = [memoryview(bytearray(n)) for _, n in self.extents]
        self.run_warm()  # faults the targets in and the file's pages back into the cache

    def run_warm(self) -> None:
        for (offset, _nbytes), target in zip(self.extents, self.targets):
            os.preadv(self.fd, [target], offset)
            blake3.blake3(target, key=DIGEST_KEY).digest()

    def run_cold(self) -> float:
        """Seconds for the reads and digests after the file's pages were dropped."""
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return timed(self.run_warm)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


BEST_CONNECTIONS = 4
BEST_NAME = f"redis-py ×{BEST_CONNECTIONS}"  # prefixes the op: "redis-py ×4 GET"


class RedisRaw:
    """redis-py SET / GET of the same bytes, in the tier's chunk size: one pipeline per view
    (``connections=1``), or every chunk at once over ``connections`` concurrent pipelines."""

    def __init__(self, url: str, connections: int = 1) -> None:
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(url, max_connections=max(8, connections))
        self.connections = connections
        self.keys: list[list[str]] = []
        self._serial = 0

    async def set_all(self, views: list[memoryview]) -> None:
        self.keys = []
        batches = []
        for view in views:
            self._serial += 1
            names = [f"raw:{os.getpid()}:{id(self)}:{self._serial}:{i}" for i in range(0, len(view), CHUNK_BYTES)]
            batches.append([(name, view[start : start + CHUNK_BYTES])
                            for name, start in zip(names, range(0, len(view), CHUNK_BYTES))])
            self.keys.append(names)
        if self.connections == 1:
            for batch in batches:
                await self._pipeline([("SET", name, value) for name, value in batch])
            return
        await self._spread([("SET", name, value) for batch in batches for name, value in batch])

    async def get_all(self) -> int:
        if self.connections == 1:
            got = 0
            for names in self.keys:
                got += sum(len(value) for value in await self._pipeline([("GET", name) for name in names]))
            return got
        replies = await self._spread([("GET", name) for names in self.keys for name in names])
        return sum(len(value) for value in replies)

    async def _pipeline(self, commands: list[tuple]) -> list:
        async with self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute()

    async def _spread(self, commands: list[tuple]) -> list:
        """``commands`` in ``connections`` contiguous groups, each a pipeline, all at once."""
        import asyncio

        size = -(-len(commands) // self.connections)
        groups = [commands[i : i + size] for i in range(0, len(commands), size)]
        return [reply for replies in await asyncio.gather(*(self._pipeline(g) for g in groups)) for reply in replies]

    async def clear(self) -> None:
        names = [name for group in self.keys for name in group]
        for start in range(0, len(names), 512):
            await self.client.delete(*names[start : start + 512])
        self.keys = []

    async def close(self) -> None:
        await self.clear()
        await self.client.aclose()


async def limits(redis_url: str, directory: Path, seconds: float) -> dict[str, float]:
    """GB/s of each raw path on 2 MiB pages: the best of repeated calls over about ``seconds``."""
    page = [memoryview(bytearray(os.urandom(2 * MiB)))]
    memory, disk, red = MemoryRaw(page), FileRaw(directory), RedisRaw(redis_url)
    best = {"memcpy+blake3": float("inf"), "write+fdatasync": float("inf"), "redis-py SET": float("inf"),
            "redis-py GET": float("inf")}
    deadline = time.perf_counter() + seconds
    try:
        for _ in range(10_000):  # bounded; the deadline ends it first
            best["memcpy+blake3"] = min(best["memcpy+blake3"], timed(memory.run))
            best["write+fdatasync"] = min(best["write+fdatasync"], timed(lambda: disk.write_sync(page)))
            disk.reset()
            best["redis-py SET"] = min(best["redis-py SET"], await atimed(lambda: red.set_all(page)))
            best["redis-py GET"] = min(best["redis-py GET"], await atimed(red.get_all))
            await red.clear()
            if time.perf_counter() > deadline:
                break
    finally:
        disk.close()
        await red.close()
    return {name: 2 * MiB / t / 1e9 for name, t in best.items()}
