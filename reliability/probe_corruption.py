"""Probe 3, storage corruption: bits flipped in, segments truncated and deleted, LMDB index
pages scribbled on, Redis chunks and manifests changed or removed — between runs of the
daemon and while it serves; then every object is loaded and ``statetier verify`` is run.

Damaged object: one whose own bytes were changed or removed (its record header or body,
its segment cut or deleted, its Redis chunks or manifest). A flipped bit in a COMMIT
record or an LMDB page damages no object: the segments hold every object and the log.

- lost: an undamaged object not served byte-exact after the damage (and the restart).
- wrong: any object served with other bytes than its put sent; a damaged object served;
  ``statetier verify`` missing a damaged object the daemon still lists.
- reported, not counted: deleted objects back after the COMMIT record of their delete was
  damaged (the delete is gone with it); objects the daemon no longer finds after an LMDB
  page was overwritten (the index checkpoint lost, the log no longer covering them).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from harness import (Budget, DaemonProcess, ProbeResult, Promise, RedisServer, internal_errors, key_prefix,
                     note_failures, passed, payload,
                     started_again)
from statetier.protocol.errors import NotFound, RejectedState
from statetier.protocol.keyring import Keyring
from statetier.tiers.disk.records import RecordCodec
from statetier.tiers.disk.segments import RECORD_HEADER_BYTES, SegmentFile
from wire import Wire

PROBE = "corruption"
PROMISE = Promise(
    "every damaged object is refused with its reason and dropped; every undamaged one is still "
    "served; `statetier verify` finds damage done while the daemon runs",
    lost_means="an undamaged object (its own bytes untouched) not served byte-exact after the damage",
    wrong_means="any object served with other bytes; a damaged object served; verify missing live damage",
)
OBJECTS = 16
DISK_DAMAGE = ("record_header", "record_body", "commit_record", "truncate_segment", "delete_segment", "lmdb_page")
REDIS_DAMAGE = ("chunk_flip", "chunk_truncate", "chunk_delete", "manifest_garbage", "manifest_delete")


def _records(disk_dir: Path, keyring: Keyring | None = None) -> tuple[dict[bytes, tuple[Path, int, int]],
                                                                      list[tuple[Path, int, int]]]:
    """object_id → (segment, offset, record_len) and the COMMIT records, from the files (their
    headers authenticated under ``keyring``: by default the daemon's, ``keyring.json`` there)."""
    codec = RecordCodec(keyring or Keyring.load(disk_dir / "keyring.json"))
    objects, commits = {}, []
    for path in sorted((disk_dir / "segments").glob("seg-*.dat")):
        file = SegmentFile(path.parent, int(path.stem.split("-")[1]), codec)
        try:
            for offset, header in file.walk():
                if header is None:
                    continue
                if header.is_object:
                    objects[header.object_id] = (path, offset, header.record_len)
                elif header.is_commit:
                    commits.append((path, offset, header.record_len))
        finally:
            file.close()
    return objects, commits


def _flip(path: Path, offset: int, rng: random.Random) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))


def _damage_disk(kind: str, disk_dir: Path, stored: dict[bytes, tuple], rng: random.Random) -> set[bytes]:
    objects, commits = _records(disk_dir)
    live = [oid for oid in objects if oid in stored]
    if kind == "record_header":
        victim = rng.choice(live)
        path, offset, _ = objects[victim]
        _flip(path, offset + rng.randrange(RECORD_HEADER_BYTES), rng)
        return {victim}
    if kind == "record_body":
        victim = rng.choice(live)
        path, offset, length = objects[victim]
        _flip(path, offset + RECORD_HEADER_BYTES + rng.randrange(length - RECORD_HEADER_BYTES), rng)
        return {victim}
    if kind == "commit_record" and commits:
        path, offset, length = rng.choice(commits)
        _flip(path, offset + rng.randrange(length), rng)
        return set()
    if kind == "truncate_segment":
        path = rng.choice(sorted({objects[oid][0] for oid in live}))
        cut = rng.randrange(path.stat().st_size)
        os.truncate(path, cut)
        return {oid for oid in live if objects[oid][0] == path and objects[oid][1] + objects[oid][2] > cut}
    if kind == "delete_segment":
        path = rng.choice(sorted({objects[oid][0] for oid in live}))
        path.unlink()
        return {oid for oid in live if objects[oid][0] == path}
    if kind == "lmdb_page":
        data = disk_dir / "index" / "data.mdb"
        size = data.stat().st_size
        for _ in range(8):
            _flip(data, rng.randrange(4096, max(4097, size)), rng)
        return set()
    return set()


def _verify_cli(url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "statetier.daemon", "verify", "--url", url],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"statetier verify exited {out.returncode}: {out.stderr[-500:]}")
    return json.loads(out.stdout)


async def _store(url: str, count: int, seed0: int, rng: random.Random, **put) -> dict[bytes, tuple]:
    wire = await Wire.open(url, model=PROBE)
    stored = {}
    try:
        for i in range(count):
            seed, size = seed0 + i, rng.choice((4 << 10, 20 << 10, 70 << 10))
            reply = await wire.put(wire.key(i % 4, key_prefix(PROBE, seed)), payload(seed, size), request_id=f"r{seed}", **put)
            stored[bytes.fromhex(reply["ref"]["state_id"])] = (seed, size, reply["ref"])
    finally:
        await wire.close()
    return stored


async def _check(url: str, stored: dict[bytes, tuple], damaged: set[bytes], deleted: set[bytes], result: ProbeResult,
                 index_damaged: bool = False) -> None:
    wire = await Wire.open(url, model=PROBE)
    try:
        for object_id, (seed, size, ref) in stored.items():
            try:
                got = await wire.load(ref=ref)
            except (NotFound, RejectedState) as exc:
                got = exc
            result.inputs += 1
            if isinstance(got, bytes) and got != payload(seed, size):
                result.wrong += 1
                result.fail(f"{object_id.hex()} served with other bytes (damaged={object_id in damaged})")
            elif object_id in deleted:
                result.add("deleted_back_after_log_damage" if isinstance(got, bytes) else "deleted_stays_deleted")
            elif object_id in damaged:
                result.add("damaged_but_served_intact" if isinstance(got, bytes) else f"damaged_refused_{_reason(got)}")
            elif not isinstance(got, bytes):
                if index_damaged:
                    result.add("not_found_after_index_damage")
                else:
                    result.lost += 1
                    result.fail(f"undamaged {object_id.hex()} not served: {got!r}")
            else:
                result.add("undamaged_served")
    finally:
        await wire.close()


def _reason(exc: Exception) -> str:
    return getattr(exc, "reason", type(exc).__name__)


async def _live_damage_and_verify(daemon: DaemonProcess, stored: dict, damaged: set, deleted: set,
                                  rng: random.Random, result: ProbeResult) -> None:
    """Flip a body bit of two objects the daemon serves right now; verify must drop exactly them."""
    objects, _ = _records(daemon.disk_dir)
    candidates = [oid for oid in stored if oid in objects and oid not in damaged and oid not in deleted]
    victims = set(rng.sample(candidates, min(2, len(candidates))))
    for victim in victims:
        path, offset, length = objects[victim]
        _flip(path, offset + RECORD_HEADER_BYTES + rng.randrange(length - RECORD_HEADER_BYTES), rng)
    result.faults += len(victims)
    report = await asyncio.to_thread(_verify_cli, daemon.url)
    result.add("verify_runs")
    result.add("verify_dropped", report["dropped"])
    if report["dropped"] < len(victims):
        result.wrong += 1
        result.fail(f"statetier verify dropped {report['dropped']}, {len(victims)} objects were damaged live")
    await _check(daemon.url, stored, damaged | victims, deleted, result)


async def _disk_round(round_no: int, rng: random.Random, result: ProbeResult) -> None:
    kind = DISK_DAMAGE[round_no % len(DISK_DAMAGE)]
    daemon = DaemonProcess(name="corrupt", host_capacity=None, metrics=False,
                           settings={"host.enabled": "false", "disk.segment_bytes": "256KiB"})
    try:
        daemon.start()
        stored = await _store(daemon.url, OBJECTS, round_no * 1000, rng)
        wire = await Wire.open(daemon.url, model=PROBE)
        deleted = set(rng.sample(sorted(stored), 2))
        for object_id in deleted:
            await wire.delete(stored[object_id][2])
        await wire.close()
        if rng.random() < 0.5:
            daemon.kill()
        else:
            daemon.stop()
        damaged = _damage_disk(kind, daemon.disk_dir, {k: v for k, v in stored.items() if k not in deleted}, rng)
        result.faults += 1
        result.add(f"damage_{kind}")
        if not started_again(daemon, result, f"no restart after {kind}"):
            return
        await _check(daemon.url, stored, damaged, deleted, result, index_damaged=kind == "lmdb_page")
        await _live_damage_and_verify(daemon, stored, damaged, deleted, rng, result)
        result.internal_errors += internal_errors(daemon)
    finally:
        daemon.close()


async def _redis_round(round_no: int, redis: RedisServer, rng: random.Random, result: ProbeResult) -> None:
    kind = REDIS_DAMAGE[round_no % len(REDIS_DAMAGE)]
    daemon = DaemonProcess(name="corrupt-redis", host_capacity=None, redis_url=redis.url, metrics=False,
                           settings={"host.enabled": "false", "disk.enabled": "false", "redis.chunk_bytes": "16KiB"})
    flusher = redis.client()
    flusher.flushall()  # each round starts from an empty Redis: the damage is this round's
    flusher.close()
    try:
        daemon.start()
        stored = await _store(daemon.url, 8, 500_000 + round_no * 100, rng)
        client = redis.client()
        victim = rng.choice(sorted(stored))
        base = f"st:{{{victim.hex()}}}"
        chunks = sorted(k.decode() for k in client.keys(f"{base}:c:*"))
        if kind == "chunk_flip":
            name = rng.choice(chunks)
            value = bytearray(client.get(name))
            value[rng.randrange(len(value))] ^= 1 << rng.randrange(8)
            client.set(name, bytes(value))
        elif kind == "chunk_truncate":
            name = rng.choice(chunks)
            client.set(name, client.get(name)[:-rng.randint(1, 100)])
        elif kind == "chunk_delete":
            client.delete(rng.choice(chunks))
        elif kind == "manifest_garbage":
            client.set(f"{base}:m", b'{"format": 1, "meta": ' + os.urandom(20))
        else:
            client.delete(f"{base}:m")
        client.close()
        result.faults += 1
        result.add(f"damage_{kind}")
        await _check(daemon.url, stored, {victim}, set(), result)
        report = await asyncio.to_thread(_verify_cli, daemon.url)
        result.add("verify_runs")
        result.add("verify_dropped", report["dropped"])
        result.internal_errors += internal_errors(daemon)
    finally:
        daemon.close()


async def run(budget: Budget, result: ProbeResult) -> None:
    rng = random.Random(303)
    deadline = budget.deadline()
    with RedisServer() as redis:
        for round_no in range(budget.scale(400, 12)):
            if passed(deadline):
                break
            with note_failures(result, f"round {round_no}", subprocess.TimeoutExpired):
                if round_no % 3 == 2:
                    await _redis_round(round_no, redis, rng, result)
                else:
                    await _disk_round(round_no, rng, result)
            result.add("rounds")
