"""PD handoff and prefix restore across two daemons over the peer transport (issue 34).

``run_peers(cluster, cases, reps, progress) -> rows`` (async), ``cluster`` a ``PDCluster``
whose daemons run with ``peers.enabled`` (policy ``descriptor``). Per case (model, tokens),
every repetition does the handoff of ``workload_pd`` (``put_many`` with ``publish=True`` on
prefill: descriptors into Redis; the joint-hit ``lookup`` and ``load_many`` on decode: the
bytes pulled from prefill into decode's arena, verified, copied out), and in the same
repetition its raw limits:

- ``socket+blake3``: the same bytes sent over a plain loopback TCP connection (one thread
  sends, this one receives into a preallocated buffer with ``recv_into``) and hashed with
  keyed BLAKE3 on the receiving side;
- ``redis-py SET+GET`` of the same bytes (``workload_raw.RedisRaw``): the Redis path's limit;
- with ``mooncake`` (the Python of a venv holding Mooncake Store), Mooncake Store's TCP put and
  get of objects of the same sizes from the process that holds them (``MooncakeRaw``, which
  runs ``benchmarks/mooncake_peer.py`` there): ``batch_put_from`` / ``batch_get_into`` over
  its TCP transfer engine, verifying nothing.

Rows (``suite="peers"``, ``tier="peer"``, ``transport`` the cluster's: ``tcp``, ``nixl``, or
``tcp+aes-gcm`` with ``peers.encrypt``, ``transport_label``): ``handoff`` (against both raws, and Mooncake's
put+get), ``lookup+load`` (the prefix restore from a peer, against ``socket+blake3`` and
Mooncake's get) and ``put+publish``. Each row
carries ``redis_commands`` and ``redis_bytes`` per handoff: what redis-server counted
(``INFO stats``: commands processed, network bytes in and out) over the put and the
lookup+load, the daemons' health probes (a PING a second each) included; and
``peer_requests`` per handoff: the pull requests prefill answered (a ``PULL_MANY`` of a
``LOAD_BATCH`` frame's objects is one; ``objects`` would be one each).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import blake3

from .workload_pd import _Handoff, _namespace
from .workload_raw import DIGEST_KEY, RedisRaw, atimed, byte_views, paired_row, timed

SOCKET_BUFFER = 8 << 20


class SocketRaw:
    """The bytes over a plain loopback socket, received into one buffer and hashed there."""

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.size = sum(len(v) for v in views)
        self.buffer = memoryview(bytearray(self.size))

    def run(self) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        sender = threading.Thread(target=self._send, args=(listener,), daemon=True)
        sender.start()
        with socket.create_connection(listener.getsockname()) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            got = 0
            while got < self.size:
                n = sock.recv_into(self.buffer[got:])
                if n == 0:
                    raise RuntimeError("the raw sender closed early")
                got += n
        blake3.blake3(self.buffer, key=DIGEST_KEY).digest()
        sender.join()
        listener.close()

    def _send(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            for view in self.views:
                conn.sendall(view)


class MooncakeRaw:
    """Mooncake Store (remote topology, TCP) in a process of its own Python: ``put(sizes)``,
    ``get()`` (seconds each, as Mooncake's client timed them), ``remove()``, ``close()``."""

    SCRIPT = Path(__file__).with_name("mooncake_peer.py")

    def __init__(self, python: str) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="st-mooncake-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python, str(self.SCRIPT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self._answer()  # {"ready": true} once the master and the storage process serve

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"mooncake stopped: see {self.log.name}")
        return json.loads(line)

    def _call(self, **command) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def put(self, sizes: list[int]) -> float:
        return float(self._call(op="put", sizes=sizes)["seconds"])

    def get(self) -> float:
        answer = self._call(op="get")
        if not answer["equal"]:
            raise RuntimeError("mooncake: the bytes got differ from the bytes put")
        return float(answer["seconds"])

    def remove(self) -> None:
        self._call(op="remove")

    def put_get(self, sizes: list[int]) -> tuple[float, float]:
        """One repetition: the objects put, got back (checked), removed; (put s, get s)."""
        put = self.put(sizes)
        got = self.get()
        self.remove()
        return put, got

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._call(op="quit")
            except (OSError, RuntimeError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def redis_counts(url: str) -> tuple[int, int]:
    """(commands processed, network bytes in + out) as redis-server counts them."""
    import redis

    with redis.Redis.from_url(url) as r:
        stats = r.info("stats")
    return int(stats["total_commands_processed"]), int(stats["total_net_input_bytes"]) + \
        int(stats["total_net_output_bytes"])


async def pull_requests(client) -> int:
    """The pull requests the daemon behind ``client`` answered so far (its peer tier's count)."""
    stats = await client.stats()
    return int(next(t for t in stats["tiers"] if t["tier"] == "peer")["extra"]["pull_requests_answered"])


async def _measure_case(prefill, decode, redis_url: str, model, tokens: int, reps: int, progress,
                        mooncake: MooncakeRaw | None = None) -> list[dict]:
    from .workload_models import request_state

    state = request_state(model, tokens, seed=tokens)
    views = byte_views(state.tensors())
    raw_socket, red = SocketRaw(views), RedisRaw(redis_url)
    handoff = _Handoff(prefill, decode, model, state)
    sizes = [len(v) for v in views]
    times: dict[str, list[float]] = {name: [] for name in ("socket", "set_get", "put", "load", "mc_put", "mc_get")}
    counts: list[tuple[int, int]] = []
    requests: list[int] = []
    try:
        for rep in range(reps + 1):  # repetition 0 warms up and checks the bytes
            t_socket = timed(raw_socket.run)
            t_set = await atimed(lambda: red.set_all(views))
            t_get = await atimed(red.get_all)
            await red.clear()
            t_mc_put, t_mc_get = (0.0, 0.0) if mooncake is None else mooncake.put_get(sizes)
            prefix = os.urandom(32)
            answered = await pull_requests(prefill)  # before Redis is counted: a stats call may ask Redis
            commands, nbytes = redis_counts(redis_url)
            t_put = await atimed(lambda: handoff.put(prefix))
            started = time.perf_counter()
            await handoff.lookup_load(prefix, check=rep == 0)
            t_load = time.perf_counter() - started
            after = redis_counts(redis_url)
            await handoff.delete()
            if rep:
                for name, value in zip(times, (t_socket, t_set + t_get, t_put, t_load, t_mc_put, t_mc_get)):
                    times[name].append(value)
                counts.append((after[0] - commands - 1, after[1] - nbytes))  # less the INFO itself
                requests.append(await pull_requests(prefill) - answered)
            progress(1)
    finally:
        await handoff.delete()
        await red.close()
    size, objects = state.nbytes(), state.objects()
    extra = {"model": model.display, "tokens": tokens, "case": f"{model.display} {tokens // 1024}k",
             "objects": objects, "reps": reps, "transport": "tcp",
             "redis_commands": statistics.median(c for c, _ in counts),
             "redis_bytes": statistics.median(b for _, b in counts),
             "peer_requests": statistics.median(requests)}
    handoff_t = [p + lo for p, lo in zip(times["put"], times["load"])]
    rows = [] if mooncake is None else [
        paired_row("peers", "peer", "handoff", size, objects, handoff_t, "mooncake TCP put+get",
                   [p + g for p, g in zip(times["mc_put"], times["mc_get"])], **extra),
        paired_row("peers", "peer", "lookup+load", size, objects, times["load"], "mooncake TCP get",
                   times["mc_get"], **extra)]
    return rows + [paired_row("peers", "peer", "handoff", size, objects, handoff_t, "socket+blake3", times["socket"],
                       **extra),
            paired_row("peers", "peer", "handoff", size, objects, handoff_t, "redis-py SET+GET", times["set_get"],
                       **extra),
            paired_row("peers", "peer", "lookup+load", size, objects, times["load"], "socket+blake3",
                       times["socket"], **extra),
            paired_row("peers", "peer", "put+publish", size, objects, times["put"], "socket+blake3",
                       times["socket"], **extra)]


def transport_label(settings: dict) -> str:
    """The rows' ``transport``: the cluster's, ``+aes-gcm`` when its pulls are encrypted."""
    transport = str(settings.get("peers.transport", "tcp"))
    return transport + ("+aes-gcm" if str(settings.get("peers.encrypt", "false")).lower() == "true" else "")


async def run_peers(cluster, cases: list, reps: int, progress, mooncake_python: str | None = None) -> list[dict]:
    from statetier.clients import AsyncClient
    from statetier.launch import served_by_tier

    rows: list[dict] = []
    mooncake = None if mooncake_python is None else MooncakeRaw(mooncake_python)
    try:
        for model, tokens in cases:
            namespace = _namespace(model)
            before = cluster.decode.counters()
            async with AsyncClient(cluster.prefill.url, namespace=namespace) as prefill, \
                    AsyncClient(cluster.decode.url, namespace=namespace) as decode:
                case_rows = await _measure_case(prefill, decode, cluster.redis_url, model, tokens, reps, progress,
                                                mooncake)
            served = served_by_tier(before, cluster.decode.counters())
            rows += [{**row, "served_by_tier": served, "transport": transport_label(cluster.settings)}
                     for row in case_rows]
    finally:
        if mooncake is not None:
            mooncake.close()
    return rows
