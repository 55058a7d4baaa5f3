"""Probe 1, crash during writes: kill -9 the daemon while clients put (durable, published,
cached), delete, and while eviction, write-behind and compaction run; restart; check.
``DAEMON_LOOPS`` daemons (each its own directory, sharing one Redis) are killed side by side,
so one's restart overlaps the others' writes: the run states its kills, their rate per minute
of the kill phase (``DAEMON_KILL_SHARE`` of the probe's time) and the recovery times.

Then kill clients that hold lookup leases and load-window regions (the shared-memory
windows of protocol 2; puts no longer reserve arena room).

- lost: a put acknowledged with ``durable: true``, or published (``publish=True``; Redis is
  never killed here) to the Redis tier (the first daemon: the bytes in Redis), that is not
  served byte-exact after the restart.
- published-only: the second daemon runs the peer tier (``peers.enabled``, policy
  ``descriptor``: Redis holds the descriptor, the bytes stay in the daemon): a publish
  acknowledged ``durable: false`` lives in its memory until the write-behind copied it to
  disk, so a kill may lose it. Counted apart (``published_only_acked_served`` /
  ``published_only_acked_lost``), never as lost; a lost one must fail loudly (a typed error:
  ``NotFound``, ``PeerLost``), never serve other bytes (that is wrong). Its durable acks are
  held to the durable promise.
- wrong: any load — by ref or by key, acknowledged or not — that returns bytes other than
  those its put sent (a torn or mixed-up object); a deleted object (delete acknowledged)
  served again; after killed clients, a lease, an arena byte or a window's file descriptor
  not given back.
- not counted as lost: a put acknowledged from the host tier only (``durable: false``):
  the documented cache promise (docs/operations.md). How many survived is reported.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

from harness import (Budget, DaemonProcess, ProbeResult, Promise, RedisServer, internal_errors, key_prefix, passed, payload,
                     percentile, started_again)
from holders import HolderPool
from statetier.protocol.errors import NotFound, RejectedState, StatetierError
from wire import Wire

PROBE = "crash"
PROMISE = Promise(
    "an acknowledged durable (or published to Redis) put survives kill -9 byte-exact; a published-only ack "
    "(peer tier, durable: false) may be lost, loudly; nothing torn or deleted is served; a killed client's "
    "leases and window regions are released",
    lost_means="a put acknowledged `durable: true` (or published to the Redis tier, Redis alive) not served "
               "byte-exact after restart",
    wrong_means="any load returning other bytes than its put sent; a deleted object served again; "
                "a lease, arena byte or window a killed client held not given back",
)
WRITERS = 4
#: Daemons killed and restarted side by side: one's restart (mostly imports, CPU-bound)
#: overlaps another's writes and checks, so a run kills more often per minute.
DAEMON_LOOPS = 2
#: The share of the probe's time that goes to daemon kills; client kills get the rest.
DAEMON_KILL_SHARE = 0.85
SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10)
HOLDERS_PER_ROUND = 8


class Ledger:
    """Every put the writers tried: seed → (category, reply meta or None, deleted). Seeds
    start at ``first_seed``: the ledgers of daemons sharing Redis never name the same
    stream (a seed makes the key, the request id and the bytes)."""

    def __init__(self, first_seed: int = 0) -> None:
        self.puts: dict[int, dict] = {}
        self.next_seed = first_seed

    def new(self, category: str, size: int) -> int:
        seed = self.next_seed
        self.next_seed += 1
        self.puts[seed] = {"category": category, "size": size, "reply": None, "deleted": False}
        return seed


async def _writer(url: str, ledger: Ledger, rng: random.Random, stop: asyncio.Event, mine: list[int]) -> None:
    try:
        wire = await Wire.open(url, model=PROBE, timeout=5.0)
    except (OSError, StatetierError):
        return
    try:
        while not stop.is_set():
            if mine and rng.random() < 0.1:  # delete one of our cached puts
                seed = mine.pop(rng.randrange(len(mine)))
                entry = ledger.puts[seed]
                if await wire.delete(entry["reply"]["ref"]):
                    entry["deleted"] = True
                else:
                    entry["delete_found_nothing"] = True
                continue
            category = rng.choices(("durable", "published", "cache"), (4, 2, 4))[0]
            size = rng.choice(SIZES)
            seed = ledger.new(category, size)
            reply = await wire.put(wire.key(seed % 8, key_prefix(PROBE, seed)), payload(seed, size),
                                   request_id=f"c{seed}", durable=category == "durable",
                                   publish=category == "published")
            ledger.puts[seed]["reply"] = reply
            if category == "cache":
                mine.append(seed)
    except (OSError, StatetierError, asyncio.TimeoutError):
        return  # the daemon died under us
    finally:
        try:
            await asyncio.wait_for(wire.close(), 2)
        except BaseException:  # noqa: BLE001 - a dead connection
            pass


async def _note_activity(url: str, result: ProbeResult) -> None:
    """What the daemon was doing in the cycle about to be killed (its counters since start)."""
    try:
        wire = await Wire.open(url, timeout=1.0)
        stats = await asyncio.wait_for(wire.stats(), 1.0)
        await wire.close()
    except (OSError, StatetierError, asyncio.TimeoutError):
        return
    tiers = {t["tier"]: t for t in stats["tiers"]}
    result.add("evictions_before_kills", tiers.get("host", {}).get("evictions", 0))
    result.add("compactions_before_kills", tiers.get("disk", {}).get("compactions_run", 0))
    result.add("kills_with_write_behind_pending", bool(stats.get("write_behind_pending")))


async def _check(url: str, ledger: Ledger, seeds: list[int], result: ProbeResult, peers: bool = False) -> None:
    """Every put of ``seeds`` loaded and judged (``peers``: the daemon publishes descriptors only)."""
    wire = await Wire.open(url, model=PROBE)
    try:
        for seed in seeds:
            entry = ledger.puts[seed]
            want = payload(seed, entry["size"])
            reply = entry["reply"]
            key = wire.key(seed % 8, key_prefix(PROBE, seed))
            try:
                got = await (wire.load(ref=reply["ref"]) if reply else wire.load(key=key))
            except (NotFound, RejectedState) as exc:
                got = exc
            except StatetierError as exc:  # a published-only object whose owner (this daemon before the kill) is gone
                if not peers:
                    raise
                got = exc
            result.inputs += 1
            if isinstance(got, bytes) and got != want:
                result.wrong += 1
                result.fail(f"seed {seed} ({entry['category']}, acked={bool(reply)}) served different bytes")
            elif entry["deleted"]:
                if isinstance(got, bytes):
                    result.wrong += 1
                    result.fail(f"seed {seed}: deleted (acknowledged), served again after the restart")
            elif reply is None:
                result.add("unacknowledged_served_intact" if isinstance(got, bytes) else "unacknowledged_absent")
            elif peers and entry["category"] == "published" and not reply.get("durable"):
                result.add("published_only_acked_served" if isinstance(got, bytes) else "published_only_acked_lost")
            elif entry["category"] in ("durable", "published") and not (reply.get("durable") or entry["category"] == "published"):
                result.add("durable_requested_not_granted")
            elif entry["category"] in ("durable", "published"):
                if not isinstance(got, bytes):
                    result.lost += 1
                    result.fail(f"seed {seed} ({entry['category']}, acknowledged on {reply['tier']}): {got!r}")
                else:
                    result.add(f"{entry['category']}_acked_served")
            else:
                result.add("cache_acked_survived" if isinstance(got, bytes) else "cache_acked_lost")
    finally:
        await wire.close()


async def _daemon_kills(daemon: DaemonProcess, deadline: float, cap: int, result: ProbeResult,
                        rng: random.Random, ledger: Ledger, recoveries: list[float]) -> None:
    """Kill-restart-check cycles of one daemon until ``deadline`` (at most ``cap``)."""
    durable_seen: list[int] = []
    for _ in range(cap):
        if passed(deadline):
            break
        first = ledger.next_seed
        stop, mine = asyncio.Event(), []
        writers = [asyncio.create_task(_writer(daemon.url, ledger, random.Random(rng.random()), stop, mine))
                   for _ in range(WRITERS)]
        await asyncio.sleep(rng.uniform(0.02, 0.5))
        await _note_activity(daemon.url, result)
        daemon.kill()  # SIGKILL, mid-whatever
        result.faults += 1
        result.add("daemon_kills")
        stop.set()
        done, pending = await asyncio.wait(writers, timeout=15)
        if pending:
            result.hangs += len(pending)
            result.fail(f"{len(pending)} writers still blocked 15 s after the kill")
            for task in pending:
                task.cancel()
        started = time.monotonic()
        if not await asyncio.to_thread(started_again, daemon, result, "restart after a kill failed"):
            return
        recoveries.append(time.monotonic() - started)
        seeds = list(range(first, ledger.next_seed))
        durable_seen += [s for s in seeds if ledger.puts[s]["category"] == "durable" and ledger.puts[s]["reply"]]
        older = rng.sample(durable_seen, min(10, len(durable_seen)))
        await _check(daemon.url, ledger, seeds + [s for s in older if s < first], result,
                     peers=daemon.settings.get("peers.enabled") == "true")


async def _daemon_kill_loops(daemons: list[DaemonProcess], deadline: float, cap: int, result: ProbeResult,
                             rng: random.Random) -> None:
    """``_daemon_kills`` of every daemon at once (each its own directory and ledger), so the
    restart of one overlaps the writes and checks of the others; the figures are their sum."""
    ledgers, recoveries = [Ledger(first_seed=index << 40) for index in range(len(daemons))], []
    started = time.monotonic()
    await asyncio.gather(*(_daemon_kills(daemon, deadline, cap, result, random.Random(rng.random()), ledger,
                                         recoveries) for daemon, ledger in zip(daemons, ledgers)))
    minutes = (time.monotonic() - started) / 60
    puts = [entry for ledger in ledgers for entry in ledger.puts.values()]
    result.notes["daemon_kill_loops"] = len(daemons)
    result.notes["daemon_kill_minutes"] = round(minutes, 2)
    result.notes["daemon_kills_per_minute"] = round(result.notes.get("daemon_kills", 0) / max(minutes, 1e-9), 1)
    result.notes["puts_tried"] = len(puts)
    result.notes["puts_acknowledged"] = sum(1 for e in puts if e["reply"])
    result.notes["acknowledged_durable"] = sum(1 for e in puts if e["reply"] and e["reply"].get("durable"))
    result.notes["deletes_acknowledged"] = sum(1 for e in puts if e["deleted"])
    result.notes["deletes_that_found_nothing"] = sum(1 for e in puts if e.get("delete_found_nothing"))
    result.notes["recovery_p50_s"] = round(percentile(recoveries, 0.5), 3)
    result.notes["recovery_max_s"] = round(max(recoveries, default=0.0), 3)


async def _client_kills(daemon: DaemonProcess, deadline: float, cap: int, result: ProbeResult) -> None:
    wire = await Wire.open(daemon.url, model=PROBE)
    prefix = key_prefix("holder", 0)  # one prefix: the holders' LOOKUP leases all three
    refs = [(await wire.put(wire.key(50 + i, prefix), payload(10_000 + i, 16 << 10),
                            request_id=f"held{i}"))["ref"] for i in range(3)]
    pool = HolderPool(daemon.url, PROBE)
    kills = 0
    try:
        for _ in range(100):  # bounded: until the write-behind of the last phase has settled
            stats = await wire.stats()
            if not stats["write_behind_pending"]:
                break
            await asyncio.sleep(0.1)
        baseline, baseline_fds = _host(stats)["bytes_used"], _fds(daemon.pid)
        for _ in range(cap):
            if passed(deadline):
                break
            pids = pool.spawn_many(HOLDERS_PER_ROUND, refs)
            held = await wire.stats()
            if held["leases"] < HOLDERS_PER_ROUND * len(refs):
                result.fail(f"holders hold {held['leases']} leases, expected {HOLDERS_PER_ROUND * len(refs)}")
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            kills += len(pids)
            for _ in range(200):  # bounded: 10 s
                stats = await wire.stats()
                fds = _fds(daemon.pid) - baseline_fds
                if stats["leases"] == 0 and _host(stats)["bytes_used"] <= baseline and not fds:
                    break
                await asyncio.sleep(0.05)
            else:
                result.wrong += 1
                result.fail(f"after killing holders: {stats['leases']} leases, host "
                            f"{_host(stats)['bytes_used'] - baseline:+d} bytes, {len(fds)} sockets/memfds still open "
                            f"({', '.join(sorted(fds)[:4])})")
    finally:
        pool.close()
        await wire.close()
    result.notes["client_kills"] = kills
    result.faults += kills


def _fds(pid: int) -> set[str]:
    """The daemon's Unix sockets and memfds (client connections and their windows); its
    Redis connections (TCP, pooled) and segment files come and go and are not counted."""
    with open("/proc/net/unix") as table:
        unix = {f"socket:[{line.split()[6]}]" for line in table.readlines()[1:] if len(line.split()) > 6}
    found = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target in unix or target.startswith("/memfd:"):
            found.add(f"{name}->{target}")
    return found


def _host(stats: dict) -> dict:
    return next(t for t in stats["tiers"] if t["tier"] == "host")


async def run(budget: Budget, result: ProbeResult) -> None:
    rng = random.Random(14)
    with RedisServer() as redis:
        daemons = [DaemonProcess(name=f"crash{i}", host_capacity="16MiB", redis_url=redis.url, metrics=False,
                                 settings={**({"peers.enabled": "true"} if i == 1 else {}),  # published-only acks
                                           "disk.segment_bytes": "1MiB", "disk.compact_interval_seconds": 0.5,
                                           "disk.capacity_bytes": "4GiB", "redis.socket_timeout": 2.0})
                   for i in range(DAEMON_LOOPS)]
        try:
            for daemon in daemons:
                daemon.start()
            await _daemon_kill_loops(daemons, budget.deadline(DAEMON_KILL_SHARE), budget.scale(4000, 40), result, rng)
            daemon = daemons[0]
            if daemon.is_running:
                await _client_kills(daemon, budget.deadline(1 - DAEMON_KILL_SHARE), budget.scale(1000, 12), result)
            result.internal_errors = sum(internal_errors(d) for d in daemons if d.is_running)
        finally:
            for daemon in daemons:
                daemon.close()
