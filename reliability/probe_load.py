"""Probe 5, load: 32–64 client processes doing mixed put, lookup, load and delete with
random sizes (4–256 KiB) for the length of the run, plus clients that stall (send loads
and stop reading) and a slow reader; the daemon's RSS and open fds sampled throughout.

- lost: an object a worker put and never deleted that a load then refuses for any reason
  but eviction (``not_found`` under the tiers' capacity is eviction, reported).
- wrong: a load returning other bytes; a worker not finished within its time + 60 s (a
  deadlock); leases left after every client is gone; RSS above the stated bound.
- Bound on the daemon's RSS: host arena + ``limits.byte_budget`` + 384 MiB (interpreter,
  torch, per-connection buffers).
- Latency: p50/p99 per op as the workers measured it, and the daemon's own share (its
  ``statetier_operation_seconds{tier="daemon"}`` histogram: from a frame received to its
  reply written) — the rest is the clients' own cost and the wait for a CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import Budget, DaemonProcess, ProbeResult, Promise, internal_errors, key_prefix, payload, percentile
from statetier.protocol.frames import PROTOCOL_VERSIONS, Frame, Op, encode_frame_bytes, hello_frame
from statetier.protocol.messages import ref_from_wire
from statetier.protocol.wire_meta import LoadMeta, wire_ref
from wire import Wire

PROBE = "load"
PROMISE = Promise(
    "32–64 busy client processes plus stalled and slow readers: no deadlock, bounded daemon memory, "
    "every load exact; p99 latency reported with the daemon's own share",
    lost_means="an object put and not deleted refused for a reason other than eviction under capacity",
    wrong_means="other bytes loaded; a worker not done within its time + 60 s; leases left; RSS over the bound",
)
HERE = Path(__file__).resolve().parent
HOST_BYTES = 256 << 20
BYTE_BUDGET = 256 << 20
RSS_BOUND = HOST_BYTES + BYTE_BUDGET + (384 << 20)
STALLED = 4


def _rss_parts(pid: int) -> dict:
    """RssAnon / RssFile / RssShmem in MiB: heap, mapped files (LMDB), the arena."""
    parts = {}
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(("RssAnon", "RssFile", "RssShmem")):
            name, value = line.split(":")
            parts[name] = int(value.split()[0]) >> 10
    return parts


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _sample(daemon: DaemonProcess, stop: asyncio.Event, samples: list) -> None:
    while not stop.is_set():
        try:
            samples.append((daemon.rss_bytes(), _fds(daemon.pid)))
        except (OSError, AssertionError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass


def _stall(path: str, refs: list[dict], namespace_hex: str) -> socket.socket:
    """A client that asks for loads of large objects and never reads the answers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(path)
    frames = [encode_frame_bytes(hello_frame(PROTOCOL_VERSIONS, tenant="default", client="stalled"))]
    for i in range(64):
        meta = LoadMeta(bytes.fromhex(namespace_hex), ref=wire_ref(ref_from_wire(refs[i % len(refs)])))
        frames.append(encode_frame_bytes(Frame(Op.LOAD, i + 1, meta)))
    sock.sendall(b"".join(frames))
    return sock


def _daemon_share(before, after) -> dict:
    out = {}
    for op in ("put", "load", "lookup", "delete"):
        count = after.delta(before, "statetier_operation_seconds_count", tier="daemon", op=op)
        total = after.delta(before, "statetier_operation_seconds_sum", tier="daemon", op=op)
        buckets = sorted((float(dict(labels)["le"]), value - before.values.get(("statetier_operation_seconds_bucket", labels), 0))
                         for labels, value in after.matching("statetier_operation_seconds_bucket").items()
                         if dict(labels).get("tier") == "daemon" and dict(labels).get("op") == op)
        p99 = next((le for le, n in buckets if count and n >= 0.99 * count), float("inf"))
        out[op] = {"count": int(count), "mean_ms": round(1000 * total / count, 2) if count else 0.0,
                   "p99_le_ms": round(1000 * p99, 1)}
    return out


async def run(budget: Budget, result: ProbeResult) -> None:
    started = time.monotonic()
    workers = budget.scale(48, 32)
    seconds = max(10.0, budget.seconds - 25)
    daemon = DaemonProcess(name="load", host_capacity=f"{HOST_BYTES >> 20}MiB",
                           settings={"limits.byte_budget": f"{BYTE_BUDGET >> 20}MiB", "disk.capacity_bytes": "2GiB"})
    out_dir = Path(tempfile.mkdtemp(prefix="st-load-"))
    try:
        daemon.start()
        wire = await Wire.open(daemon.url, model="stall")
        refs = [(await wire.put(wire.key(i, key_prefix("stall", i)), payload(i, 1 << 20), request_id="s"))["ref"]
                for i in range(4)]
        before = daemon.scrape()
        rss_at_rest = daemon.rss_bytes()
        stop, samples = asyncio.Event(), []
        sampler = asyncio.create_task(_sample(daemon, stop, samples))
        stalled = [_stall(str(daemon.socket_path), refs, wire.namespace.hex()) for _ in range(STALLED)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
        procs = [subprocess.Popen([sys.executable, str(HERE / "load_worker.py"), daemon.url, str(i), str(seconds),
                                   str(out_dir / f"{i}.json")], env=env) for i in range(workers)]
        slow_bytes = 0
        for proc in procs:  # the slow reader: the first stalled client reads 4 KiB now and then
            while proc.poll() is None and time.monotonic() - started < seconds + 60:
                try:
                    stalled[0].settimeout(0.2)
                    slow_bytes += len(stalled[0].recv(4096))
                except (socket.timeout, OSError):
                    pass
                await asyncio.sleep(0.3)
            if proc.poll() is None:
                result.hangs += 1
                result.fail(f"worker {proc.args[3]} still running {seconds + 60:.0f} s after it started")
                proc.kill()
            proc.wait()
        result.notes["slow_reader_bytes"] = slow_bytes
        for sock in stalled:
            sock.close()
        after = daemon.scrape()
        result.notes["rss_parts_end_mib"] = _rss_parts(daemon.pid)
        stop.set()
        await sampler
        third = max(1, len(samples) // 3)
        early, late = max((s[0] for s in samples[:third]), default=0), max((s[0] for s in samples[-third:]), default=0)
        result.notes["rss_first_third_peak_mib"], result.notes["rss_last_third_peak_mib"] = early >> 20, late >> 20
        latencies: dict[str, list[float]] = {}
        reported = list(out_dir.glob("*.json"))
        if len(reported) < workers:
            result.crashes += workers - len(reported)
            result.fail(f"{workers - len(reported)} of {workers} workers ended without their results")
        for path in reported:
            data = json.loads(path.read_text())
            result.wrong += data["wrong"]
            for op, values in data["ops"].items():
                latencies.setdefault(op, []).extend(values)
            for reason, count in data["errors"].items():
                result.add(f"error_{reason}", count)
        result.inputs = sum(len(v) for v in latencies.values())
        result.faults = STALLED  # clients that stop reading (the first of them reads a little now and then)
        result.notes["workers"] = workers
        result.notes["stalled_clients"] = STALLED
        result.notes["ops_per_s"] = round(result.inputs / seconds, 1)
        result.notes["client_latency_ms"] = {op: {"p50": round(1000 * percentile(v, 0.5), 1),
                                                  "p99": round(1000 * percentile(v, 0.99), 1)} for op, v in latencies.items()}
        result.notes["daemon_latency_ms"] = _daemon_share(before, after)
        peak_rss = max((s[0] for s in samples), default=0)
        result.notes["rss_peak_mib"] = peak_rss >> 20
        result.notes["rss_end_mib"] = (samples[-1][0] >> 20) if samples else 0
        result.notes["rss_at_rest_mib"] = rss_at_rest >> 20
        result.notes["rss_bound_mib"] = RSS_BOUND >> 20
        result.notes["fds_peak"] = max((s[1] for s in samples), default=0)
        result.notes["fds_end"] = _fds(daemon.pid)
        if peak_rss > RSS_BOUND:
            result.wrong += 1
            result.fail(f"daemon RSS peaked at {peak_rss >> 20} MiB, over the {RSS_BOUND >> 20} MiB bound")
        for _ in range(100):  # bounded: 10 s for the stalled connections' leases to go
            stats = await wire.stats()
            if stats["leases"] == 0:
                break
            await asyncio.sleep(0.1)
        else:
            result.wrong += 1
            result.fail(f"{stats['leases']} leases left after every client went away")
        result.notes["dropped_on_demotion"] = stats["dropped_on_demotion"]
        result.notes["tiers"] = {t["tier"]: {"objects": t["objects"], "evictions": t.get("evictions", 0)}
                                 for t in stats["tiers"]}
        await wire.close()
        result.internal_errors = internal_errors(daemon)
    finally:
        daemon.close()
