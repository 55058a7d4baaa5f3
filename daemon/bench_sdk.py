"""The end-to-end SDK benchmark: puts, loads and lookups through ``statetier.clients``.

- ``run_sdk(url, plan, *, tmp_dir, report) -> (rows, details)`` — against the daemon at
  ``url``, or with ``url=None`` a private ``statetier serve`` subprocess with the host tier
  only (the hot path, without write-behind to disk competing for the cores); ``report``
  gets each row as soon as it is measured. Rows follow ``daemon.bench.result``.
- ``SdkPlan`` with ``QUICK`` / ``FULL``; ``Payloads`` (the pages and their raw limit);
  ``measure_puts``, ``measure_loads``, ``measure_round_trips`` (one row each). The daemon
  and echo server processes are in ``daemon/bench_procs.py``.

Transfers: KV pages ``(2, 8, T, 128)`` bfloat16 — 64 KiB (16 tokens), 2 MiB (512), 32 MiB
(8192) — put, then loaded by ``StateRef``, through the shared-memory arena (``shm``) and
inline over the socket (``inline``). One timed call moves ``batch`` objects in flight at
once (``asyncio.gather``). Its raw limit, timed in the same repetition: a copy of the same
bytes into a preallocated buffer plus keyed BLAKE3 of them, one thread, ``batch`` times.
Round trips: ``lookup`` of a joint hit (1 attention + 1 SSM layer, leased; the release is
outside the timing) and ``ping``, each next to a raw round trip of a request of the same
size to a uvloop ``Protocol`` echo server in another process over a Unix socket.
Every figure: median over all timed calls of all repetitions, after warm-up calls.
Throughput rows also give the CPU time per call, ``client_cpu_us`` (this process, every
thread) and ``daemon_cpu_us`` (own daemon only, from /proc at 10 ms resolution): on a
shared machine CPU time varies far less than wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .bench import KiB, MiB, percentile, result
from .bench_procs import EchoClient, echo_server, own_daemon, process_cpu_seconds

RAW = "memcpy+blake3"
RAW_RTT = "uvloop echo"
THROUGHPUT_TARGET = 0.7
LATENCY_TARGET = 1 / 3  # p50 at most 3× the raw round trip
BLOCK_TOKENS = 16
_SERIAL = itertools.count(1)


@dataclass(frozen=True)
class SdkPlan:
    reps: int
    calls: dict[int, int]  # payload size -> timed calls per repetition
    batches: dict[int, tuple[int, ...]]  # payload size -> objects in flight per call
    round_trips: int  # timed round trips per repetition
    warmup: int = 2


QUICK = SdkPlan(3, {64 * KiB: 12, 2 * MiB: 5, 32 * MiB: 2}, {64 * KiB: (1, 8), 2 * MiB: (1, 8), 32 * MiB: (1,)}, 150)
FULL = SdkPlan(7, {64 * KiB: 40, 2 * MiB: 16, 32 * MiB: 4}, {64 * KiB: (1, 8), 2 * MiB: (1, 8), 32 * MiB: (1,)}, 600)


# ---------------------------------------------------------------------------- transfers


class Payloads:
    """``count`` KV pages of ``size`` bytes, and the raw limit's preallocated destinations."""

    def __init__(self, size: int, count: int, seed: int = 0) -> None:
        import torch

        tokens = size // (2 * 8 * 128 * 2)
        gen = torch.Generator().manual_seed(seed)
        self.tensors = [torch.randint(-(2 ** 15), 2 ** 15, (2, 8, tokens, 128), dtype=torch.int16, generator=gen)
                        .view(torch.bfloat16) for _ in range(count)]
        self.tokens = tokens
        self._sources = [memoryview(t.view(torch.uint8).numpy()).cast("B") for t in self.tensors]
        self._targets = [memoryview(bytearray(size)) for _ in range(count)]
        for src, dst in zip(self._sources, self._targets):
            dst[:] = src  # fault the destinations in before timing

    def raw_call(self, batch: int, digest_key: bytes) -> None:
        import blake3

        for src, dst in zip(self._sources[:batch], self._targets[:batch]):
            dst[:] = src
            blake3.blake3(dst, key=digest_key).digest()


@dataclass
class _Times:
    raw: list[float]
    sdk: list[float]
    client_cpu: float = 0.0  # CPU seconds over all timed SDK calls: this process (every thread)
    daemon_cpu: float | None = 0.0  # … and the daemon's, when its pid is known (Linux /proc)


async def _timed(call) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


async def _paired(raw_call, sdk_call, plan: SdkPlan, calls: int, daemon_pid: int | None, after_rep=None) -> _Times:
    """Per repetition: ``calls`` raw calls, then ``calls`` SDK calls, then ``after_rep`` untimed."""
    times = _Times([], [])
    for _ in range(plan.reps):
        for _ in range(calls):
            started = time.perf_counter()
            raw_call()
            times.raw.append(time.perf_counter() - started)
        client_before, daemon_before = time.process_time(), process_cpu_seconds(daemon_pid)
        for _ in range(calls):
            times.sdk.append(await _timed(sdk_call))
        times.client_cpu += time.process_time() - client_before
        daemon_after = process_cpu_seconds(daemon_pid)
        if daemon_before is None or daemon_after is None or times.daemon_cpu is None:
            times.daemon_cpu = None
        else:
            times.daemon_cpu += daemon_after - daemon_before
        if after_rep is not None:
            await after_rep()
    return times


def _throughput_row(path: str, op: str, size: int, batch: int, times: _Times) -> dict:
    moved = size * batch
    sdk, raw = statistics.median(times.sdk), statistics.median(times.raw)
    return result("sdk", path, op, size, batch, moved / sdk / 1e9, RAW, moved / raw / 1e9, sdk * 1e6,
                  percentile(times.sdk, 99) * 1e6, metric="throughput", target=THROUGHPUT_TARGET,
                  gbps_best=moved / min(times.sdk) / 1e9, raw_gbps_best=moved / min(times.raw) / 1e9,
                  raw_p50_us=raw * 1e6, raw_p99_us=percentile(times.raw, 99) * 1e6, samples=len(times.sdk),
                  client_cpu_us=times.client_cpu / len(times.sdk) * 1e6,
                  daemon_cpu_us=None if times.daemon_cpu is None else times.daemon_cpu / len(times.sdk) * 1e6)


class _Session:
    """One client (one transfer path) and the naming of what it stores."""

    def __init__(self, client, path: str, digest_key: bytes, daemon_pid: int | None = None) -> None:
        self.client, self.path, self.digest_key, self.daemon_pid = client, path, digest_key, daemon_pid

    def _request_id(self) -> str:
        return f"bench-{self.path}-{next(_SERIAL)}"  # a stream of its own: no put supersedes another

    async def put_all(self, payloads: Payloads, batch: int, prefix: bytes) -> list:
        client = self.client
        key = client.kv_key(0, prefix, 0, payloads.tokens)
        if batch == 1:
            return [await client.put(key, {"kv": payloads.tensors[0]}, request_id=self._request_id())]
        return list(await asyncio.gather(*(client.put(key, {"kv": t}, request_id=self._request_id())
                                           for t in payloads.tensors[:batch])))

    async def load_all(self, refs: list) -> list:
        if len(refs) == 1:
            return [await self.client.load(refs[0])]
        return list(await asyncio.gather(*(self.client.load(ref) for ref in refs)))

    async def delete_all(self, refs: list) -> None:
        await asyncio.gather(*(self.client.delete(ref) for ref in refs))


async def measure_puts(session: _Session, payloads: Payloads, batch: int, plan: SdkPlan, prefix: bytes) -> dict:
    stored: list = []

    async def put_call() -> None:
        stored.extend(await session.put_all(payloads, batch, prefix))

    async def drop() -> None:
        await session.delete_all(stored)
        stored.clear()

    size = payloads.tensors[0].numel() * 2
    for _ in range(plan.warmup):
        payloads.raw_call(batch, session.digest_key)
        await put_call()
    await drop()
    times = await _paired(lambda: payloads.raw_call(batch, session.digest_key), put_call, plan,
                          plan.calls[size], session.daemon_pid, after_rep=drop)
    return _throughput_row(session.path, "put", size, batch, times)


async def measure_loads(session: _Session, payloads: Payloads, batch: int, plan: SdkPlan, prefix: bytes) -> dict:
    import torch

    refs = await session.put_all(payloads, batch, prefix)
    try:
        for loaded, tensor in zip(await session.load_all(refs), payloads.tensors):
            if not torch.equal(loaded["kv"].view(torch.int16), tensor.view(torch.int16)):
                raise RuntimeError(f"the {session.path} load returned other bytes than were put")
        for _ in range(plan.warmup):
            payloads.raw_call(batch, session.digest_key)
            await session.load_all(refs)
        size = payloads.tensors[0].numel() * 2
        times = await _paired(lambda: payloads.raw_call(batch, session.digest_key),
                              lambda: session.load_all(refs), plan, plan.calls[size], session.daemon_pid)
    finally:
        await session.delete_all(refs)
    return _throughput_row(session.path, "load", size, batch, times)


# ---------------------------------------------------------------------------- round trips


async def measure_round_trips(client, echo: EchoClient, plan: SdkPlan, transport: str) -> list[dict]:
    import torch

    from statetier.protocol.frames import Frame, Op, encode_frame
    from statetier.protocol.identity import prefix_hash

    prefix = prefix_hash(list(range(BLOCK_TOKENS)))
    gen = torch.Generator().manual_seed(7)
    refs = [await client.put_kv(0, prefix, 0, BLOCK_TOKENS, {"kv": torch.randn(2, 8, BLOCK_TOKENS, 128, generator=gen)
                                                               .to(torch.bfloat16)}, request_id="bench-lookup"),
            await client.put_ssm(1, prefix, BLOCK_TOKENS, {"conv": torch.randn(3, 8192, generator=gen).to(torch.bfloat16),
                                                            "ssm": torch.randn(8192, 16, generator=gen)},
                                 request_id="bench-lookup")]
    boundaries = [(BLOCK_TOKENS, prefix)]

    async def lookup() -> None:
        found = await client.lookup([0], [1], boundaries)
        if found.tokens != BLOCK_TOKENS:
            raise RuntimeError(f"the benchmark lookup found {found.tokens} tokens, not {BLOCK_TOKENS}")
        await client.release(found.lease_ids)

    meta = {"ns": client.namespace.hex(), "attention_layers": [0], "ssm_layers": [1],
            "boundaries": [[BLOCK_TOKENS, prefix.hex()]], "kv_layout": "blocks", "shard": 0, "lease": True}
    sizes = {"lookup": _frame_bytes(encode_frame(Frame(Op.LOOKUP, 1, meta))),
             "ping": _frame_bytes(encode_frame(Frame(Op.PING, 1, {})))}
    rows = []
    try:
        for op, call in (("lookup", lambda: client.lookup([0], [1], boundaries)), ("ping", client.ping)):
            message = bytes(sizes[op])
            raw, sdk = [], []
            for _ in range(plan.warmup * 10):
                await echo.round_trip(message)
                await lookup() if op == "lookup" else await call()
            for _ in range(plan.reps):
                for _ in range(plan.round_trips):
                    raw.append(await _timed(lambda: echo.round_trip(message)))
                for _ in range(plan.round_trips):
                    started = time.perf_counter()
                    answer = await call()
                    sdk.append(time.perf_counter() - started)
                    if op == "lookup":
                        await client.release(answer.lease_ids)
            rows.append(_latency_row(transport, op, sizes[op], raw, sdk))
    finally:
        for ref in refs:
            await client.delete(ref)
    return rows


def _frame_bytes(parts) -> int:
    return sum(len(part) for part in parts)


def _latency_row(transport: str, op: str, size: int, raw: list[float], sdk: list[float]) -> dict:
    p50, raw_p50 = statistics.median(sdk), statistics.median(raw)
    return result("sdk", transport, op, size, 1, size / p50 / 1e9, RAW_RTT, size / raw_p50 / 1e9, p50 * 1e6,
                  percentile(sdk, 99) * 1e6, metric="latency", target=LATENCY_TARGET, raw_p50_us=raw_p50 * 1e6,
                  raw_p99_us=percentile(raw, 99) * 1e6, samples=len(sdk))


# ---------------------------------------------------------------------------- the suite


async def _run(url: str | None, plan: SdkPlan, directory: Path, report) -> tuple[list[dict], dict]:
    from statetier.clients import AsyncClient
    from statetier.protocol.identity import NamespaceSpec, prefix_hash
    from statetier.protocol.keyring import Keyring

    digest_key = Keyring.generate().active.digest_key  # the raw limit's BLAKE3 key: same cost as the daemon's
    details: dict = {"daemon": url or "own", "plan": asdict(plan)}
    daemon_pid = None
    async with contextlib.AsyncExitStack() as stack:
        if url is None:
            daemon = await stack.enter_async_context(own_daemon(directory))
            url, daemon_pid = daemon.url, daemon.pid
            details["daemon_command"] = daemon.command[1:]
        namespace = NamespaceSpec(f"statetier-bench/{os.getpid()}", kv_block_size=BLOCK_TOKENS, kv_dtype="bfloat16")
        clients = {"shm": AsyncClient(url, namespace=namespace, use_shm=True),
                   "inline": AsyncClient(url, namespace=namespace, use_shm=False)}
        for client in clients.values():
            await stack.enter_async_context(client)
        if not clients["shm"].uses_shm:
            del clients["shm"]  # TCP, or a daemon without a host tier: nothing to map
        details["paths"] = list(clients)
        rows: list[dict] = []
        for size, batches in plan.batches.items():
            payloads = Payloads(size, max(batches))
            prefix = prefix_hash(list(range(payloads.tokens)))
            for path, client in clients.items():
                session = _Session(client, path, digest_key, daemon_pid)
                for batch in batches:
                    for measure in (measure_puts, measure_loads):
                        row = await measure(session, payloads, batch, plan, prefix)
                        rows.append(row)
                        report(row)
        echo = await stack.enter_async_context(echo_server(directory))
        transport = "unix" if url.startswith("unix:") or "://" not in url else url.split("://", 1)[0]
        for row in await measure_round_trips(clients["inline"], echo, plan, transport):
            rows.append(row)
            report(row)
    return rows, details


def run_sdk(url: str | None, plan: SdkPlan, *, tmp_dir: str | None = None, report=lambda row: None):
    """Run the SDK suite; returns (result rows, details for the JSON ``suites.sdk`` entry)."""
    import torch

    torch.set_num_threads(1)  # client copies single-threaded (PERFORMANCE.md)
    directory = Path(tempfile.mkdtemp(prefix="st-bench-", dir=tmp_dir or "/tmp"))  # AF_UNIX paths are short
    try:
        try:
            import uvloop
        except ImportError:
            return asyncio.run(_run(url, plan, directory, report))
        return uvloop.run(_run(url, plan, directory, report))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
