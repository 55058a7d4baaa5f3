"""Concurrent clients: 1, 4 and 16 inference workers putting and loading 2 MiB KV pages.

``run_clients(levels, pages, reps, directory, progress) -> rows`` starts its own daemon
(``procs.own_daemon``: host arena only, the hot path) and a pool of client
processes (forked from a forkserver that has imported torch and the SDK once), each with
its own ``AsyncClient`` over shared memory. For each level N, every repetition runs
these phases on N workers at once, each phase started together (every worker is armed,
then all are told to go):

- ``raw``  — each worker copies its ``pages`` pages into preallocated buffers and takes
  their keyed BLAKE3, one page at a time (the raw limit of the same concurrency);
- ``put``  — each worker puts its pages, one at a time (``put`` returns the ``StateRef``);
- ``load`` — each worker loads them back by ``StateRef``;
- then, untimed, each worker deletes them.

Aggregate GB/s = N × pages × 2 MiB ÷ (last worker's end − first worker's start). Rows
(``suite="clients"``, ``tier="shm"``, ``batch=N``): ``put`` and ``load`` against
``memcpy+blake3``; ``ratio`` is the median over repetitions of raw phase time ÷ phase
time; ``p50_us``/``p99_us`` (and ``raw_p50_us``/``raw_p99_us``) are per-page latencies over
every worker and repetition.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import time

from .workload_raw import MemoryRaw, byte_views, paired_row

PAGE_TOKENS = 512  # (2, 8, 512, 128) bfloat16 = 2 MiB
PAGE_BYTES = 2 * 8 * PAGE_TOKENS * 128 * 2
PRELOAD = ["torch", "uvloop", "blake3", "statetier.clients.async_client", "workload_raw", "workload_clients"]


# ---------------------------------------------------------------------------- worker process


def worker_main(conn, url: str, pages: int, seed: int) -> None:
    """A client process: answers ``(phase)`` with ``"armed"``, runs it on ``"go"``, reports
    ``(start, end, per-page seconds)``; ``"stop"`` ends it."""
    import torch
    import uvloop

    from statetier.clients import AsyncClient
    from statetier.protocol.identity import NamespaceSpec

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.empty((2, 8, PAGE_TOKENS, 128), dtype=torch.int16).random_(generator=generator)
               .view(torch.bfloat16) for _ in range(pages)]
    raws = [MemoryRaw([view]) for view in byte_views(tensors)]
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    client = AsyncClient(url, namespace=NamespaceSpec("bench-clients", kv_block_size=PAGE_TOKENS,
                                                      kv_dtype="bfloat16"))
    loop.run_until_complete(client.connect())
    refs: list = []

    async def put(tensor):
        refs.append(await client.put_kv(0, os.urandom(32), 0, PAGE_TOKENS, {"kv": tensor},
                                        request_id=f"w{seed}-{len(refs)}"))

    phases = {"raw": lambda i: raws[i].run(),
              "put": lambda i: loop.run_until_complete(put(tensors[i])),
              "load": lambda i: loop.run_until_complete(client.load(refs[i]))}
    conn.send("ready")
    try:
        for phase in iter(conn.recv, "stop"):
            if phase == "delete":
                loop.run_until_complete(asyncio.gather(*(client.delete(ref) for ref in refs)))
                refs.clear()
                conn.send("done")
                continue
            conn.send("armed")
            conn.recv()  # go
            started, latencies = time.perf_counter(), []
            for i in range(pages):
                t0 = time.perf_counter()
                phases[phase](i)
                latencies.append(time.perf_counter() - t0)
            conn.send((started, time.perf_counter(), latencies))
    finally:
        loop.run_until_complete(client.close())
        loop.close()


# ---------------------------------------------------------------------------- the pool


class ClientPool:
    """``size`` worker processes connected to ``url``; ``phase(name, n)`` runs on the first n."""

    def __init__(self, url: str, size: int, pages: int) -> None:
        self.url, self.size, self.pages = url, size, pages
        self.workers: list = []

    def start(self) -> "ClientPool":
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        for seed in range(self.size):
            mine, theirs = context.Pipe()
            process = context.Process(target=worker_main, args=(theirs, self.url, self.pages, seed),
                                      daemon=True, name=f"bench-client-{seed}")
            process.start()
            self.workers.append((process, mine))
        for process, conn in self.workers:
            self._expect(process, conn, "ready", 120)
        return self

    def _expect(self, process, conn, what, timeout: float = 60):
        if not conn.poll(timeout):
            raise RuntimeError(f"{process.name} did not answer within {timeout} s (alive: {process.is_alive()})")
        answer = conn.recv()
        if what is not None and answer != what:
            raise RuntimeError(f"{process.name} answered {answer!r}, not {what!r}")
        return answer

    def phase(self, name: str, n: int) -> tuple[float, list[float]]:
        """Run ``name`` on n workers at once: (wall seconds, per-page latencies of all)."""
        chosen = self.workers[:n]
        for _, conn in chosen:
            conn.send(name)
        for process, conn in chosen:
            self._expect(process, conn, "armed")
        for _, conn in chosen:
            conn.send("go")
        reports = [self._expect(process, conn, None, 300) for process, conn in chosen]
        wall = max(end for _, end, _ in reports) - min(start for start, _, _ in reports)
        return wall, [t for _, _, latencies in reports for t in latencies]

    def delete(self, n: int) -> None:
        for _, conn in self.workers[:n]:
            conn.send("delete")
        for process, conn in self.workers[:n]:
            self._expect(process, conn, "done")

    def close(self) -> None:
        for _process, conn in self.workers:
            try:
                conn.send("stop")
            except OSError:
                pass
        for process, _ in self.workers:
            process.join(30)
            if process.is_alive():
                process.terminate()
                process.join()
        self.workers = []


# ---------------------------------------------------------------------------- the workload


def _level_rows(n: int, pages: int, walls: dict, latencies: dict) -> list[dict]:
    from .rows import percentile

    size = n * pages * PAGE_BYTES
    rows = []
    for op in ("put", "load"):
        row = paired_row("clients", "shm", op, size, n, walls[op], "memcpy+blake3", walls["raw"], clients=n,
                         pages_per_client=pages, page_bytes=PAGE_BYTES)
        row.update(p50_us=percentile(latencies[op], 50) * 1e6, p99_us=percentile(latencies[op], 99) * 1e6,
                   raw_p50_us=percentile(latencies["raw"], 50) * 1e6,
                   raw_p99_us=percentile(latencies["raw"], 99) * 1e6, samples=len(latencies[op]),
                   wall_p50_us=statistics.median(walls[op]) * 1e6)
        rows.append(row)
    return rows


async def run_clients(levels: tuple[int, ...], pages: int, reps: int, directory, progress) -> list[dict]:
    from .procs import own_daemon

    rows: list[dict] = []
    async with own_daemon(directory) as daemon:
        pool = await asyncio.to_thread(ClientPool(daemon.url, max(levels), pages).start)
        try:
            for n in levels:
                walls: dict[str, list[float]] = {name: [] for name in ("raw", "put", "load")}
                latencies: dict[str, list[float]] = {name: [] for name in ("raw", "put", "load")}
                for rep in range(reps + 1):  # repetition 0 warms up
                    for name in ("raw", "put", "load"):
                        wall, per_page = await asyncio.to_thread(pool.phase, name, n)
                        if rep:
                            walls[name].append(wall)
                            latencies[name] += per_page
                    await asyncio.to_thread(pool.delete, n)
                    progress(1)
                rows += _level_rows(n, pages, walls, latencies)
        finally:
            await asyncio.to_thread(pool.close)
    return rows
