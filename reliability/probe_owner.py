"""Probe 8, the owner lost mid-pull: a PD load across two daemons with the peer tier on.

Two daemons (prefill, decode) with ``peers.enabled`` (policy ``descriptor``: Redis holds
descriptors, the bytes stay on prefill), one keyring, one redis-server. Each cycle prefill
publishes a few large objects; decode loads them all at once (each pulled from prefill);
a moment into the pulls prefill is killed (kill -9) or frozen (SIGSTOP). Every load ends
byte-exact, or as a typed error (``PeerLost``, ``NotFound``: the caller recomputes) within
the pull's deadline; then a load of another object of the lost owner is a miss at once once
it is fenced (killed: its address refuses at once; frozen: once its liveness key expired,
``peers.liveness_ttl_seconds``), or one more typed failure before. Prefill is started again
(or thawed) for the next cycle. Figures: loads served,
recomputed, the time from the fault to the last failed load (p50, max).

- lost: a load decode served (so promoted into its arena) not served byte-exact again by
  decode at the end.
- wrong: other bytes served; an untyped error or traceback; a load that neither ends nor
  fails within ``HANG_AFTER`` seconds of the fault (counted as a hang).
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
from statetier.protocol.errors import StatetierError
from statetier.protocol.keyring import Keyring
from wire import Wire

PROBE = "owner"
PROMISE = Promise(
    "The daemon holding an object killed (kill -9) or frozen (SIGSTOP) while another pulls it: every load is "
    "byte-exact or a typed error (recompute) within the pull deadline; a killed owner is fenced at once (its "
    "address refuses), a frozen one once its liveness key expired",
    lost_means="a load decode served, not served byte-exact again by decode at the end",
    wrong_means="other bytes served; an untyped error or traceback; a load still open 3 s past the pull deadline",
)
PULL_TIMEOUT = 1.0
HANG_AFTER = PULL_TIMEOUT + 3.0
SETTINGS = {"peers.enabled": "true", "peers.pull_timeout_seconds": PULL_TIMEOUT}
SIZE = 8 << 20
OBJECTS = 6
FAULTS = ("kill", "sigstop")


class Pair:
    def __init__(self, result: ProbeResult, rng: random.Random, keyring_path: str) -> None:
        self.result, self.rng, self.seed = result, rng, 0
        self.redis = RedisServer().start()
        self.prefill = DaemonProcess(name="chaos-owner", host_capacity="256MiB", redis_url=self.redis.url,
                                     keyring=keyring_path, settings=SETTINGS)
        self.decode = DaemonProcess(name="chaos-puller", host_capacity="256MiB", redis_url=self.redis.url,
                                    keyring=keyring_path, settings=SETTINGS)
        self.served: list[tuple[int, dict]] = []  # what decode served: (seed, ref)
        self.fault_to_failed: list[float] = []

    async def start(self) -> None:
        await asyncio.to_thread(self.prefill.start)
        await asyncio.to_thread(self.decode.start)

    async def close(self) -> None:
        for daemon in (self.prefill, self.decode):
            self.result.internal_errors += internal_errors(daemon)
            daemon.close()
        self.redis.close()

    async def publish(self) -> list[tuple[int, dict]]:
        wire = await Wire.open(self.prefill.url, model=PROBE)
        try:
            out = []
            for _ in range(OBJECTS):
                self.seed += 1
                reply = await wire.put(wire.key(self.seed % 8, key_prefix(PROBE, self.seed)),
                                       payload(self.seed, SIZE), request_id=f"r{self.seed}", publish=True)
                out.append((self.seed, reply["ref"]))
            return out
        finally:
            await wire.close()

    async def load(self, wire: Wire, seed: int, ref: dict, failed_at: list[float]) -> None:
        self.result.inputs += 1
        try:
            got = await wire.load(ref=ref)
        except StatetierError as exc:
            failed_at.append(time.monotonic())
            self.result.add(f"recomputed_{exc.reason}")
            return
        if got != payload(seed, SIZE):
            self.result.wrong += 1
            self.result.fail(f"seed {seed} served with other bytes")
            return
        self.served.append((seed, ref))
        self.result.add("served")

    async def cycle(self, fault: str) -> None:
        objects = await self.publish()
        wire = await Wire.open(self.decode.url, model=PROBE)
        try:
            failed_at: list[float] = []
            loads = asyncio.gather(*(self.load(wire, seed, ref, failed_at) for seed, ref in objects[:-1]))
            await asyncio.sleep(self.rng.uniform(0.0, 0.03))  # a moment into the pulls
            faulted = time.monotonic()
            self.prefill.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            self.result.faults += 1
            try:
                await asyncio.wait_for(loads, HANG_AFTER)
            except asyncio.TimeoutError:
                self.result.hangs += 1
                self.result.fail(f"{fault}: a load still open {HANG_AFTER:g} s after the fault")
            if failed_at:
                self.fault_to_failed.append(max(failed_at) - faulted)
            await self.fenced_miss(wire, *objects[-1])
        finally:
            await wire.close()
        await self.owner_back(fault)

    async def fenced_miss(self, wire: Wire, seed: int, ref: dict) -> None:
        """The last object of the lost owner: a miss (or, not yet fenced, one more typed failure)."""
        failed: list[float] = []
        await self.load(wire, seed, ref, failed)
        self.result.add("after_fault_typed" if failed else "after_fault_served")

    async def owner_back(self, fault: str) -> None:
        if fault == "sigstop":
            self.prefill.send_signal(signal.SIGCONT)
            return
        self.prefill.kill()  # reaped; its directory stays for the next start
        await asyncio.to_thread(self.prefill.start)

    async def check_all(self) -> None:
        wire = await Wire.open(self.decode.url, model=PROBE)
        try:
            for seed, ref in self.served:
                try:
                    ok = await wire.load(ref=ref) == payload(seed, SIZE)
                except StatetierError:
                    ok = False
                if not ok:
                    self.result.lost += 1
                    self.result.fail(f"decode served seed {seed} once, not at the end")
        finally:
            await wire.close()


async def run(budget: Budget, result: ProbeResult) -> None:
    rng, deadline = random.Random(53), budget.deadline()
    directory = tempfile.mkdtemp(prefix="st-chaos-keys-", dir="/tmp")
    keyring_path = os.path.join(directory, "keyring.json")
    Keyring.generate().save(keyring_path)
    pair = Pair(result, rng, keyring_path)
    try:
        await pair.start()
        for _ in range(budget.scale(40, 1)):
            for fault in FAULTS:
                if passed(deadline):
                    break
                with note_failures(result, fault):
                    await pair.cycle(fault)
        await pair.check_all()
    finally:
        await pair.close()
        shutil.rmtree(directory, ignore_errors=True)
    result.notes.update({
        "fault_to_failed_p50_s": round(percentile(pair.fault_to_failed, 0.5), 2),
        "fault_to_failed_max_s": round(max(pair.fault_to_failed, default=0), 2),
        "pull_timeout_s": PULL_TIMEOUT})
