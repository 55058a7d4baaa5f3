"""Probe 7, Redis faults under PD load: Redis is a tier, not a dependency of the local path.

Two daemons (prefill, decode) share one keyring and one redis-server (``appendfsync always``),
reached through a delaying TCP proxy (``statetier.launch.tcp_proxy``). Each cycle injects, in
turn: Redis killed and restarted with its data; killed and restarted without it (a fresh
directory); frozen (SIGSTOP, then SIGCONT); the proxy slowed (every chunk late, below the
call deadline), then held (no byte forwarded, past it). While healthy, prefill publishes
and decode loads by ref; during each fault both keep working locally: prefill puts without
publish and loads its own objects, decode loads what it already holds; publishes are refused
(typed). Before the hold, a PD round runs through the slowed proxy: served, health up.
Figures: local ops served during the faults, the time from a fault to
``/readyz/strict`` degraded and ``statetier_redis_up`` 0 on both daemons (detect) and from its end
to ready and 1 again (recover).

- lost: a put acknowledged (before, during or after a fault) not served byte-exact by the
  daemon that acknowledged it at the end.
- wrong: other bytes served; an untyped error or traceback; health not following a change
  within ``FOLLOW_WITHIN`` seconds (counted as a hang).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import tempfile
import time

from harness import (Budget, DaemonProcess, ProbeResult, Promise, RedisServer, internal_errors, key_prefix,
                     note_failures, passed, payload, percentile)
from statetier.launch.tcp_proxy import DelayProxy
from statetier.protocol.errors import StatetierError
from statetier.protocol.keyring import Keyring
from wire import Wire

PROBE = "redis"
PROMISE = Promise(
    "Redis killed, frozen, restarted with and without its data, or slowed and held by a proxy, during PD load "
    "on two daemons: local loads and puts keep being served, never wrong bytes, health follows within 5 s",
    lost_means="a put acknowledged before, during or after a fault not served byte-exact by its daemon at the end",
    wrong_means="other bytes served; an untyped error or traceback; health not following within 10 s (a hang)",
)
PERSISTENT = ("--appendonly", "yes", "--appendfsync", "always")
FOLLOW_WITHIN = 10.0  # the promise is 5 s; twice that on a busy machine before it counts as a hang
SETTINGS = {"redis.socket_timeout": 2.0, "redis.probe_interval_seconds": 0.5}
SIZES = (4 << 10, 64 << 10)
FAULTS = ("kill_keep_data", "kill_lose_data", "sigstop", "proxy_held")
SLOW_S = 0.05  # the proxy's delay per chunk before it holds: each round trip 0.1 s late (a slow WAN)


class Node:
    """One daemon, its connection and what it acknowledged: (seed, size, ref)."""

    def __init__(self, name: str, daemon: DaemonProcess) -> None:
        self.name, self.daemon = name, daemon
        self.wire: Wire | None = None
        self.acked: list[tuple[int, int, dict]] = []

    async def open(self) -> None:
        self.wire = await Wire.open(self.daemon.url, model=PROBE)

    async def health(self) -> tuple[bool, bool]:
        """(readyz/strict says ready, redis_up is 1): /readyz itself stays 200 while degraded."""
        status, _ = await asyncio.to_thread(self.daemon.http_get, "/readyz/strict")
        up = (await asyncio.to_thread(self.daemon.scrape)).value("statetier_redis_up")
        return status == 200, up == 1


class Cluster:
    def __init__(self, result: ProbeResult, rng: random.Random) -> None:
        self.result, self.rng, self.seed = result, rng, 0
        self.redis = RedisServer().start(extra_args=PERSISTENT)
        self.proxy = DelayProxy(self.redis.port).start()
        self.nodes: list[Node] = []
        self.detect: list[float] = []
        self.recover: list[float] = []

    async def start(self, keyring_path) -> None:
        for name in ("prefill", "decode"):
            daemon = DaemonProcess(name=f"chaos-{name}", host_capacity="64MiB", redis_url=self.proxy.url,
                                   keyring=keyring_path, settings=SETTINGS)
            await asyncio.to_thread(daemon.start)
            node = Node(name, daemon)
            await node.open()
            self.nodes.append(node)

    async def close(self) -> None:
        for node in self.nodes:
            if node.wire is not None:
                await node.wire.close()
            self.result.internal_errors += internal_errors(node.daemon)
            node.daemon.close()
        self.proxy.close()
        self.redis.close()

    async def put(self, node: Node, *, publish: bool, counted: str) -> dict | None:
        assert node.wire is not None
        self.seed += 1
        size = self.rng.choice(SIZES)
        self.result.inputs += 1
        try:
            reply = await node.wire.put(node.wire.key(self.seed % 8, key_prefix(PROBE, self.seed)),
                                        payload(self.seed, size), request_id=f"r{self.seed}", publish=publish)
        except StatetierError as exc:
            self.result.add(f"{counted}_refused_{exc.reason}")
            return None
        self.acked_by(node, size, reply["ref"])
        self.result.add(f"{counted}_served")
        return reply["ref"]

    def acked_by(self, node: Node, size: int, ref: dict) -> None:
        node.acked.append((self.seed, size, ref))

    async def load(self, node: Node, seed: int, size: int, ref: dict, counted: str) -> bool:
        assert node.wire is not None
        self.result.inputs += 1
        try:
            got = await node.wire.load(ref=ref)
        except StatetierError as exc:
            self.result.add(f"{counted}_refused_{exc.reason}")
            return False
        if got != payload(seed, size):
            self.result.wrong += 1
            self.result.fail(f"{node.name}: seed {seed} served with other bytes ({counted})")
            return False
        self.result.add(f"{counted}_served")
        return True

    async def healthy_round(self) -> None:
        """PD: prefill publishes, decode loads each by ref (promoting it into its own tiers)."""
        prefill, decode = self.nodes
        for _ in range(self.rng.randint(3, 6)):
            ref = await self.put(prefill, publish=True, counted="pd_put")
            if ref is not None and await self.load(decode, self.seed, prefill.acked[-1][1], ref, "pd_load"):
                decode.acked.append(prefill.acked[-1])

    async def outage_round(self) -> None:
        """Local work on both daemons while Redis is unreachable; a publish, refused."""
        prefill, decode = self.nodes
        for _ in range(self.rng.randint(3, 6)):
            await self.put(prefill, publish=False, counted="outage_put")
            for node in (prefill, decode):
                if node.acked:
                    seed, size, ref = self.rng.choice(node.acked)
                    await self.load(node, seed, size, ref, "outage_load")
        await self.put(prefill, publish=True, counted="outage_publish")

    async def wait_health(self, ready: bool, since: float, into: list[float], what: str) -> None:
        deadline = since + FOLLOW_WITHIN
        while time.monotonic() < deadline:
            states = [await node.health() for node in self.nodes]
            if all(state == (ready, ready) for state in states):
                into.append(time.monotonic() - since)
                return
            await asyncio.sleep(0.1)
        self.result.hangs += 1
        self.result.fail(f"{what}: readyz/redis_up not {'up' if ready else 'down'} within {FOLLOW_WITHIN:g} s")

    async def check_all(self) -> None:
        for node in self.nodes:
            for seed, size, ref in node.acked:
                if not await self.load(node, seed, size, ref, "final"):
                    self.result.lost += 1
                    self.result.fail(f"{node.name}: acknowledged seed {seed} not served at the end")
            self.result.add(f"{node.name}_acked_checked", len(node.acked))


async def _fault(cluster: Cluster, fault: str) -> None:
    """One fault: begin it, wait for both daemons to say so, work locally, end it, wait for ready."""
    begun = time.monotonic()
    end = _begin(cluster, fault)
    cluster.result.faults += 1
    await cluster.wait_health(False, begun, cluster.detect, f"{fault} began")
    await cluster.outage_round()
    ended = time.monotonic()
    end()
    await cluster.wait_health(True, ended, cluster.recover, f"{fault} ended")


def _begin(cluster: Cluster, fault: str):
    """Start ``fault``; the function that ends it."""
    redis, proxy = cluster.redis, cluster.proxy
    if fault == "kill_keep_data":
        redis.kill()
        return lambda: redis.start(redis.port, PERSISTENT)
    if fault == "kill_lose_data":
        port = redis.port
        redis.kill()
        redis.close()  # its directory goes: restarted empty

        def fresh() -> None:
            cluster.redis = RedisServer().start(port, PERSISTENT)
        return fresh
    if fault == "sigstop":
        os.kill(redis.pid, signal.SIGSTOP)
        return lambda: os.kill(cluster.redis.pid, signal.SIGCONT)
    proxy.hold()

    def released() -> None:
        proxy.release()
        proxy.delay = 0.0
    return released


async def _slowed_round(cluster: Cluster) -> None:
    """PD load through the slowed proxy: served (late, within the deadline), health stays up."""
    cluster.proxy.delay = SLOW_S
    await cluster.healthy_round()
    states = [await node.health() for node in cluster.nodes]
    if states != [(True, True)] * len(states):
        cluster.result.fail("the slowed proxy made a daemon report Redis down")


async def run(budget: Budget, result: ProbeResult) -> None:
    rng, deadline = random.Random(47), budget.deadline()
    directory = tempfile.mkdtemp(prefix="st-chaos-keys-", dir="/tmp")
    keyring_path = os.path.join(directory, "keyring.json")
    Keyring.generate().save(keyring_path)
    cluster = Cluster(result, rng)
    try:
        await cluster.start(keyring_path)
        for _ in range(budget.scale(50, 1)):
            for fault in FAULTS:
                if passed(deadline):
                    break
                await cluster.healthy_round()
                with note_failures(result, fault):
                    if fault == "proxy_held":
                        await _slowed_round(cluster)
                    await _fault(cluster, fault)
        await cluster.healthy_round()
        await cluster.check_all()
    finally:
        await cluster.close()
        shutil.rmtree(directory, ignore_errors=True)
    result.notes.update({
        "detect_p50_s": round(percentile(cluster.detect, 0.5), 2),
        "detect_max_s": round(max(cluster.detect, default=0), 2),
        "recover_p50_s": round(percentile(cluster.recover, 0.5), 2),
        "recover_max_s": round(max(cluster.recover, default=0), 2)})
