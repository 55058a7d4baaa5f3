"""Check the host and device tiers on a machine with CUDA; print ratios to raw torch copies.

Run as ``python scripts/gpu_check.py`` (well under 2 minutes). Without CUDA it prints
"no CUDA, skipping" and exits 0. With CUDA it checks:

1. the host arena is registered as pinned memory: ``Tensor.is_pinned()`` over the arena
   (the driver's ``cudaPointerGetAttributes``), and by timing, a copy from the arena
   against one from pageable memory;
2. device-tier store and load of 2 MiB and 32 MiB sealed objects on the tier's side stream
   round-trip exactly (``open_sealed`` verifies signature and payload digest);
3. throughput of each tier path as a ratio to a raw torch copy of the same bytes between a
   pinned tensor and the GPU on one stream (target >= 0.8), one object at a time and eight
   in flight;
4. a write-then-save race (issue 42, item 6): on a stream of its own, a kernel sleeps, then
   writes a GPU tensor, and the tensor is saved at once through a real daemon's put window
   (``clients.producer_fence``); the bytes loaded back must equal the tensor's final ones
   in every round. The same rounds without the fence (a stand-in ``cuda`` whose events do
   nothing) are reported, not judged: how many tore says whether the race was provoked.

Exit status 1 when a correctness check fails (pinning, bytes); a ratio below the target is
reported, not fatal: the machine may be shared, so run it again before believing one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a source checkout

MIB = 1024 * 1024
SIZES = (2 * MIB, 32 * MIB)
TARGET = 0.8
IN_FLIGHT = 8


def sealed_object(payload_bytes: int):
    from statetier.protocol.dtypes import TensorSpec
    from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, new_state_id
    from statetier.protocol.keyring import dev_keyring
    from statetier.protocol.sealed import decode_header, seal_object
    from statetier.tiers.base import ObjectMeta

    key = StateKey(NamespaceSpec("gpu-check").namespace(), Kind.SSM, 0, os.urandom(32), 0, 128)
    blob = seal_object(key, Provenance("gpu-check"), [(TensorSpec("state", "uint8", (payload_bytes,)), os.urandom(payload_bytes))],
                       keyring=dev_keyring(), state_id=new_state_id(), version=1)
    return ObjectMeta.from_header(decode_header(blob)), blob


def renamed(meta):
    return dataclasses.replace(meta, object_id=os.urandom(16))


async def timed(fn, repeats: int) -> float:
    """Median seconds of ``await fn()`` after one warm-up call."""
    await fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class Raw:
    """Raw torch copies between a pinned tensor and the GPU, on one side stream."""

    def __init__(self, torch, nbytes: int) -> None:
        self.torch = torch
        self.stream = torch.cuda.Stream()
        self.host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(IN_FLIGHT)]
        self.gpu = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(IN_FLIGHT)]

    async def h2d(self, count: int = 1, source=None) -> None:
        with self.torch.cuda.stream(self.stream):
            for i in range(count):
                self.gpu[i].copy_(self.host[i] if source is None else source, non_blocking=True)
        self.stream.synchronize()

    async def d2h(self, count: int = 1) -> None:
        with self.torch.cuda.stream(self.stream):
            for i in range(count):
                self.host[i].copy_(self.gpu[i], non_blocking=True)
        self.stream.synchronize()


class Report:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.below: list[str] = []

    def check(self, what: str, passed: bool) -> None:
        print(f"  [{'ok' if passed else 'FAIL'}] {what}")
        if not passed:
            self.failures.append(what)

    def ratio(self, path: str, nbytes: int, tier_s: float, raw_s: float) -> None:
        ratio = raw_s / tier_s
        mark = "ok" if ratio >= TARGET else "below target"
        print(f"  {path:<34} {nbytes // MIB:>3} MiB  tier {nbytes / tier_s / 1e9:6.2f} GB/s"
              f"  raw {nbytes / raw_s / 1e9:6.2f} GB/s  ratio {ratio:4.2f}  {mark}")
        if ratio < TARGET:
            self.below.append(f"{path} {nbytes // MIB} MiB: {ratio:.2f}")


async def check_size(torch, host, device, payload_bytes: int, report: Report) -> None:
    from statetier.protocol.keyring import dev_keyring
    from statetier.protocol.sealed import open_sealed

    meta, blob = sealed_object(payload_bytes)
    ticket = await host.prepare_store(meta)
    ticket.view[:] = blob
    await host.complete_store(ticket, True)
    host_lease = await host.prepare_load(meta.object_id)
    source = await host.read(host_lease)  # a read-only view of the pinned arena
    nbytes = meta.size
    print(f"- object of {nbytes} bytes ({payload_bytes // MIB} MiB payload)")

    async def store(m=meta) -> None:
        store_ticket = await device.prepare_store(m)
        done = False
        try:
            await device.write(store_ticket, [source])
            done = True
        finally:
            await device.complete_store(store_ticket, done)

    await store()
    lease = await device.prepare_load(meta.object_id)
    report.check("device store from the arena, load via staging: bytes verify", bytes(open_sealed(
        await device.read(lease), None, dev_keyring()).payload) == blob[meta.header_len:])
    landing = await host.prepare_store(renamed(meta))
    await device.read(lease, into=landing.view)
    report.check("device read_into the arena: bytes equal", bytes(landing.view) == blob)
    await host.complete_store(landing, False)
    await device.complete_load(lease)
    await device.delete(meta.object_id)

    raw = Raw(torch, nbytes)
    raw.host[0].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    repeats = 30 if nbytes < 8 * MIB else 8
    pageable = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    offset = host_lease.location[0]
    arena_tensor = torch.frombuffer(host.arena_view, dtype=torch.uint8)[offset : offset + nbytes]
    from_arena = await timed(lambda: raw.h2d(source=arena_tensor), repeats)
    from_pageable = await timed(lambda: raw.h2d(source=pageable), repeats)
    print(f"  arena→GPU {nbytes / from_arena / 1e9:.2f} GB/s vs pageable→GPU {nbytes / from_pageable / 1e9:.2f} GB/s")
    arena_tensor = None  # drop the export of the arena before the tier closes

    async def store_and_drop() -> None:
        await store()
        await device.delete(meta.object_id)

    report.ratio("store host→device, 1 in flight", nbytes, await timed(store_and_drop, repeats),
                 await timed(raw.h2d, repeats))

    async def stores_in_flight() -> None:
        metas = [renamed(meta) for _ in range(IN_FLIGHT)]
        await asyncio.gather(*(store(m) for m in metas))
        for m in metas:
            await device.delete(m.object_id)

    report.ratio(f"store host→device, {IN_FLIGHT} in flight", nbytes * IN_FLIGHT,
                 await timed(stores_in_flight, max(3, repeats // 4)),
                 await timed(lambda: raw.h2d(IN_FLIGHT), max(3, repeats // 4)))

    await store()
    lease = await device.prepare_load(meta.object_id)
    landing = await host.prepare_store(renamed(meta))

    async def read_staged() -> None:
        staged = await device.prepare_load(meta.object_id)
        await device.read(staged)
        await device.complete_load(staged)

    report.ratio("load device→host, pinned staging", nbytes, await timed(read_staged, repeats),
                 await timed(raw.d2h, repeats))
    report.ratio("load device→host, into the arena", nbytes,
                 await timed(lambda: device.read(lease, into=landing.view), repeats), await timed(raw.d2h, repeats))
    await host.complete_store(landing, False)
    await device.complete_load(lease)
    await device.delete(meta.object_id)
    await host.complete_load(host_lease)
    await host.delete(meta.object_id)


RACE_ROUNDS = 8
RACE_SLEEP_CYCLES = 200_000_000  # ~0.1 s on a current GPU: the write lands well after the save began


class _NoFence:
    """``torch.cuda`` for ``producer_fence`` whose events order nothing (the unfenced control)."""

    class _Inert:
        def record(self, stream) -> None: ...

        def wait_event(self, event) -> None: ...

    def Event(self):  # noqa: N802 - torch.cuda's name
        return self._Inert()

    def current_stream(self, device):
        return self._Inert()


async def race_rounds(torch, client, fenced: bool) -> int:
    """Rounds (of ``RACE_ROUNDS``) whose saved bytes differ from the tensor's final bytes."""
    transfers = client._transfers_now()
    transfers.cuda = torch.cuda if fenced else _NoFence()
    producer = torch.cuda.Stream()
    tensor = torch.zeros(8 * MIB // 4, dtype=torch.float32, device="cuda")
    torn = 0
    for n in range(RACE_ROUNDS):
        key = client.ssm_key(n, os.urandom(32), 16)
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(RACE_SLEEP_CYCLES)
            tensor.fill_(float(n + 1))  # the producer's write, queued behind the sleep
            ref = await client.put(key, {"x": tensor}, request_id=f"race-{fenced}-{n}")  # saved at once
        torch.cuda.synchronize()
        loaded = await client.load(ref)
        torn += not torch.equal(loaded["x"], tensor.cpu())
    transfers.cuda = torch.cuda
    return torn


async def check_write_then_save(torch, report: Report) -> None:
    from statetier.clients import AsyncClient
    from statetier.launch import DaemonProcess
    from statetier.protocol.identity import NamespaceSpec

    print("- a kernel writes a tensor on its own stream; the tensor is saved at once (put window)")
    with DaemonProcess(name="gpu-race", host_capacity="512MiB") as daemon:
        async with AsyncClient(daemon.url, namespace=NamespaceSpec("gpu-race"), use_shm=True) as client:
            report.check("the client maps the put window (the fenced path runs)", client.uses_shm)
            fenced = await race_rounds(torch, client, fenced=True)
            report.check(f"fenced saves equal the final tensor ({RACE_ROUNDS - fenced}/{RACE_ROUNDS} rounds)", fenced == 0)
            unfenced = await race_rounds(torch, client, fenced=False)
            print(f"  unfenced control: {unfenced}/{RACE_ROUNDS} rounds tore "
                  f"({'the race was provoked' if unfenced else 'the race was not provoked: the fenced result proves less'})")


async def run(torch) -> int:
    from statetier.tiers.memory import DeviceTier, DeviceTierOptions
    from statetier.tiers.memory import HostTier, HostTierOptions

    report = Report()
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    async with (HostTier(HostTierOptions(1024 * MIB, pin_memory=True)) as host,
                DeviceTier(DeviceTierOptions(1024 * MIB, device="cuda")) as device):
        arena = torch.frombuffer(host.arena_view, dtype=torch.uint8)
        report.check("host arena is registered as pinned memory (is_pinned)", host.is_pinned and arena.is_pinned())
        del arena
        for size in SIZES:
            await check_size(torch, host, device, size, report)
        stats = device.stats()
        report.check("device tier: no lease violations, nothing left leased",
                     stats.extra["lease_violations"] == 0 and stats.leases == 0)
    await check_write_then_save(torch, report)
    if report.below:
        print(f"ratios below {TARGET}: " + "; ".join(report.below))
    if report.failures:
        print("FAILED: " + "; ".join(report.failures))
        return 1
    print("all correctness checks passed")
    return 0


def main() -> int:
    try:
        import torch
    except ImportError:
        print("no CUDA (torch is not installed), skipping")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA, skipping")
        return 0
    return asyncio.run(run(torch))


if __name__ == "__main__":
    sys.exit(main())
