"""Probe 4, dependency faults: Redis killed and restarted under load, a Redis Cluster
master killed, Redis at ``maxmemory``, a full disk (a small tmpfs), a full host arena.

During each fault clients keep working; afterwards the daemon — never restarted — must
serve again on its own.

- lost: an acknowledged put not served byte-exact once the fault is over (Redis runs with
  ``appendfsync always`` here, so what it acknowledged survives its own kill).
- wrong: bytes other than the put sent; an untyped error (anything but a statetier error
  reaching the client, or a traceback in the daemon's log); the daemon not serving again
  within 30 s of the fault's end (counted as a hang).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import tempfile
import time
from pathlib import Path

from harness import (Budget, DaemonProcess, ProbeResult, Promise, RedisCluster, RedisServer, internal_errors, key_prefix,
                    note_failures, passed, payload, percentile)
from statetier.protocol.errors import StatetierError, Unavailable
from wire import Wire

PROBE = "faults"
PROMISE = Promise(
    "when Redis dies, a Cluster master dies, Redis hits maxmemory, the disk fills or the arena is "
    "full: typed errors only, no wrong data, and service comes back without a daemon restart",
    lost_means="a put acknowledged before or during a fault not served byte-exact once the fault is over",
    wrong_means="other bytes served; an untyped error or traceback; no recovery within 30 s (a hang)",
)
PERSISTENT = ("--appendonly", "yes", "--appendfsync", "always")
RECOVER_WITHIN = 30.0


class Tally:
    """Acknowledged puts, to check at the end (``finish``); typed errors by class."""

    def __init__(self, result: ProbeResult, name: str) -> None:
        self.result, self.name = result, name
        self.acked: list[tuple[int, int, dict]] = []
        self.seed = hash(name) % 1_000_000 * 1000

    async def put(self, wire: Wire, size: int, **options) -> bool:
        self.seed += 1
        self.result.inputs += 1
        try:
            reply = await wire.put(wire.key(self.seed % 4, key_prefix(self.name, self.seed)), payload(self.seed, size),
                                   request_id=f"{self.name}{self.seed}", **options)
        except StatetierError as exc:
            self.result.add(f"{self.name}_typed_{exc.reason}")
            return False
        self.acked.append((self.seed, size, reply["ref"]))
        return True

    async def check(self, wire: Wire) -> None:
        for seed, size, ref in self.acked:
            try:
                got = await _load_settled(wire, ref)
            except StatetierError as exc:
                self.result.lost += 1
                self.result.fail(f"{self.name}: acknowledged seed {seed} not served after the fault: {exc!r}")
                continue
            if got != payload(seed, size):
                self.result.wrong += 1
                self.result.fail(f"{self.name}: seed {seed} served with other bytes")
        self.result.add(f"{self.name}_acked_checked", len(self.acked))

    async def finish(self, wire: Wire, daemon: DaemonProcess) -> None:
        """The end of a fault: every acknowledged put checked, the wire closed, the daemon's tracebacks counted."""
        await self.check(wire)
        await wire.close()
        self.result.internal_errors += internal_errors(daemon)


async def _load_settled(wire: Wire, ref: dict) -> bytes:
    """A load by ref, retried while the backend is still coming back (``Unavailable``)."""
    for _ in range(int(RECOVER_WITHIN / 0.2)):
        try:
            return await wire.load(ref=ref)
        except Unavailable:
            await asyncio.sleep(0.2)
    return await wire.load(ref=ref)


async def _until_serving(call, result: ProbeResult, what: str) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < RECOVER_WITHIN:
        if await call():
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    result.hangs += 1
    result.fail(f"{what}: not serving again {RECOVER_WITHIN:g} s after the fault ended")
    return None


async def _redis_restarts(budget: Budget, deadline: float, result: ProbeResult, rng: random.Random) -> None:
    redis = RedisServer().start(extra_args=PERSISTENT)
    daemon = DaemonProcess(name="faults-redis", host_capacity="32MiB", redis_url=redis.url, metrics=False,
                           settings={"redis.socket_timeout": 1.0})
    tally, recoveries = Tally(result, "redis_restart"), []
    try:
        daemon.start()
        wire = await Wire.open(daemon.url, model=PROBE)
        for _ in range(budget.scale(200, 3)):
            if passed(deadline):
                break
            for _ in range(rng.randint(3, 10)):  # load before the kill
                await tally.put(wire, rng.choice((4 << 10, 64 << 10)), publish=rng.random() < 0.5)
            redis.kill()
            result.faults += 1
            for _ in range(3):  # load while it is down: typed refusals only
                await tally.put(wire, 4 << 10, publish=True)
            redis.start(redis.port, PERSISTENT)
            took = await _until_serving(lambda: tally.put(wire, 4 << 10, publish=True), result, "redis restart")
            if took is not None:
                recoveries.append(took)
        await tally.finish(wire, daemon)
        result.notes["redis_kills"] = result.notes.get("redis_kills", 0) + len(recoveries)
        result.notes["redis_recovery_p50_s"] = round(percentile(recoveries, 0.5), 3)
        result.notes["redis_recovery_max_s"] = round(max(recoveries, default=0), 3)
    finally:
        daemon.close()
        redis.close()


async def _cluster_master(result: ProbeResult) -> None:
    with RedisCluster() as cluster:
        daemon = DaemonProcess(name="faults-cluster", host_capacity="32MiB", redis_url=cluster.url, metrics=False,
                               settings={"redis.socket_timeout": 1.0, "redis.cluster": "true"})
        tally = Tally(result, "cluster")
        try:
            daemon.start()
            wire = await Wire.open(daemon.url, model=PROBE)
            for _ in range(12):
                await tally.put(wire, 8 << 10, publish=True)
            victim = cluster.nodes[0]
            port = victim.port
            victim.kill()
            result.faults += 1
            for _ in range(12):
                await tally.put(wire, 8 << 10, publish=True)
            victim.start(port, _cluster_node_args(port))
            took = await _until_serving(lambda: tally.put(wire, 8 << 10, publish=True), result, "cluster master back")
            result.notes["cluster_recovery_s"] = round(took or 0, 3)
            await tally.finish(wire, daemon)
        finally:
            daemon.close()


def _cluster_node_args(port: int) -> list[str]:
    from statetier.launch.redis_cluster import cluster_node_args
    return cluster_node_args(port)


async def _maxmemory(result: ProbeResult) -> None:
    with RedisServer() as redis:
        redis.stop()
        redis.start(redis.port, ("--maxmemory", "4mb", "--maxmemory-policy", "noeviction"))
        daemon = DaemonProcess(name="faults-maxmem", host_capacity="64MiB", redis_url=redis.url, metrics=False)
        tally = Tally(result, "maxmemory")
        try:
            daemon.start()
            wire = await Wire.open(daemon.url, model=PROBE)
            refused = 0
            for _ in range(60):  # 60 × 256 KiB published: far past 4 MB
                refused += not await tally.put(wire, 256 << 10, publish=True)
            result.faults += 1
            if not refused:
                result.fail("maxmemory: no put was refused")
            await tally.finish(wire, daemon)
        finally:
            daemon.close()


async def _full_disk(result: ProbeResult) -> None:
    directory = Path(tempfile.mkdtemp(prefix="st-fulldisk-", dir="/tmp"))
    disk = directory / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    if not mounted:
        result.notes["full_disk"] = "skipped: cannot mount a tmpfs here"
        return
    daemon = DaemonProcess(name="faults-disk", host_capacity=None, metrics=False,
                           settings={"host.enabled": "false", "disk.segment_bytes": "512KiB",
                                     "disk.compact_interval_seconds": 0.5})
    daemon.directory = directory
    tally = Tally(result, "full_disk")
    try:
        daemon.start()
        wire = await Wire.open(daemon.url, model=PROBE)
        refused = 0
        for _ in range(200):  # 200 × 64 KiB: twice the filesystem
            refused += not await tally.put(wire, 64 << 10)
            if refused >= 5:
                break
        result.faults += 1
        if not refused:
            result.fail("full disk: no put was refused")
        for _seed, _size, ref in tally.acked[: len(tally.acked) // 2]:  # make room
            await wire.delete(ref)
        tally.acked = tally.acked[len(tally.acked) // 2:]
        took = await _until_serving(lambda: tally.put(wire, 64 << 10), result, "full disk freed")
        result.notes["full_disk_recovery_s"] = round(took or 0, 3)
        await tally.finish(wire, daemon)
    finally:
        daemon.kill()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        daemon.close()


async def _arena_full(result: ProbeResult) -> None:
    """The host arena full of objects clients hold leases on (nothing evictable), no tier below."""
    daemon = DaemonProcess(name="faults-arena", host_capacity="8MiB", metrics=False,
                           settings={"disk.enabled": "false"})
    tally = Tally(result, "arena_full")
    try:
        daemon.start()
        wire = await Wire.open(daemon.url, model=PROBE)
        holder = await Wire.open(daemon.url, model=PROBE)
        prefix, refusal, layers = key_prefix("arena", 0), None, []
        for layer in range(400):  # bounded: 8 MiB / 64 KiB is 128 objects at most
            try:
                await holder.put(holder.key(layer, prefix), payload(layer, 64 << 10), request_id=f"arena{layer}")
            except StatetierError as exc:
                refusal = exc
                break
            layers.append(layer)
            await holder.lookup([layer], prefix, lease=True)  # held: not evictable
        result.faults += 1
        result.add(f"arena_full_put_typed_{getattr(refusal, 'reason', 'none')}")
        if refusal is None:
            result.fail("arena full: puts never refused")
        await tally.put(wire, 64 << 10)  # refused (typed) while everything is leased
        await holder.close()  # its leases go with its connection
        took = await _until_serving(lambda: tally.put(wire, 64 << 10), result, "arena freed")
        result.notes["arena_recovery_s"] = round(took or 0, 3)
        await tally.finish(wire, daemon)
    finally:
        daemon.close()


async def run(budget: Budget, result: ProbeResult) -> None:
    rng = random.Random(44)
    for step in (_arena_full, _maxmemory, _full_disk, _cluster_master):
        with note_failures(result, step.__name__):
            await step(result)
    with note_failures(result, "redis restarts"):
        await _redis_restarts(budget, budget.deadline(), result, rng)
