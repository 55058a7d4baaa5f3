"""Mooncake Store's TCP get of the same objects, for the peers workload (issue 40, item 9).

Not part of the package's runtime: ``workload_peers.MooncakeRaw`` runs this file with the
Python of a venv that has ``mooncake-transfer-engine-non-cuda`` (``statetier bench workloads
--mooncake-python PATH``; ``../shared/peers/setup.sh mooncake`` makes one at
/tmp/venv-mooncake). It imports nothing of statetier.

It starts ``mooncake_master`` (with its HTTP metadata server) and a ``mooncake_client`` that
owns the global segment (the "remote" topology: every get crosses a process boundary over
Mooncake's TCP transfer engine on 127.0.0.1, as a decode node's get from the prefill node's
store would), then answers JSON lines on stdin, one JSON line each on stdout:

- ``{"op": "put", "sizes": [n, ...]}`` → the objects put from a registered buffer
  (``batch_put_from``), ``{"seconds": t}``;
- ``{"op": "get"}`` → all of them fetched into a registered buffer (``batch_get_into``),
  ``{"seconds": t, "equal": bool}`` (the bytes compared after the clock stopped);
- ``{"op": "remove"}`` → the objects removed; ``{"op": "quit"}``.

Every process it starts is stopped by its pid when stdin closes.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

HOST = "127.0.0.1"
SEGMENT = "4 GB"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"mooncake: nothing listens on {port} after {timeout} s")


def binary(name: str) -> str:
    import mooncake

    path = os.path.join(os.path.dirname(mooncake.__file__), name)
    os.chmod(path, os.stat(path).st_mode | 0o111)
    return path


class Store:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logdir = tempfile.mkdtemp(prefix="st-mooncake-")
        self.keys: list[str] = []
        self.sizes: list[int] = []
        self.round = 0

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(os.path.join(self.logdir, f"{name}.log"), "w")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    def start(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        rpc, meta, admin, client = free_port(), free_port(), free_port(), free_port()
        self._spawn("master", [binary("mooncake_master"), f"--rpc_address={HOST}", f"--rpc_port={rpc}",
                               "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
                               f"--http_metadata_server_port={meta}", f"--metrics_host={HOST}",
                               f"--metrics_port={admin}", "--enable_metric_reporting=false",
                               "--default_kv_lease_ttl=1000"])
        wait_port(rpc)
        wait_port(meta)
        metadata, master = f"http://{HOST}:{meta}/metadata", f"{HOST}:{rpc}"
        self._spawn("storage", [binary("mooncake_client"), f"--host={HOST}", f"--port={client}",
                                f"--global_segment_size={SEGMENT}", "--local_buffer_size=64 MB",
                                f"--master_server_address={master}", f"--metadata_server={metadata}",
                                "--protocol=tcp"])
        wait_port(client)
        time.sleep(1.0)  # the storage client mounts its segment after it listens
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(HOST, metadata, 0, 64 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"mooncake: setup returned {rc}")
        self.capacity = 0
        self.source = self.target = ctypes.create_string_buffer(0)  # sized by the first put

    def _buffers(self, total: int) -> None:
        if total <= self.capacity:
            return
        if self.capacity:  # a larger case: the smaller buffers unregistered first (one registration each)
            for buffer in (self.source, self.target):
                self.store.unregister_buffer(ctypes.addressof(buffer))
        total = 1 << (total - 1).bit_length()  # a power of two: few registrations over a run
        self.source = ctypes.create_string_buffer(total)
        self.target = ctypes.create_string_buffer(total)
        for buffer in (self.source, self.target):
            if self.store.register_buffer(ctypes.addressof(buffer), total) != 0:
                raise RuntimeError("mooncake: register_buffer failed")
        ctypes.memmove(self.source, os.urandom(total), total)
        self.capacity = total

    def _addresses(self, base: ctypes.Array) -> list[int]:
        out, at = [], ctypes.addressof(base)
        for size in self.sizes:
            out.append(at)
            at += size
        return out

    def put(self, sizes: list[int]) -> dict:
        self.round += 1
        self.sizes = list(sizes)
        self._buffers(sum(sizes))
        self.keys = [f"r{self.round}-{i}" for i in range(len(sizes))]
        started = time.perf_counter()
        codes = self.store.batch_put_from(self.keys, self._addresses(self.source), self.sizes)
        seconds = time.perf_counter() - started
        if any(code != 0 for code in codes):
            raise RuntimeError(f"mooncake: batch_put_from returned {codes}")
        return {"seconds": seconds}

    def get(self) -> dict:
        ctypes.memset(self.target, 0, sum(self.sizes))
        started = time.perf_counter()
        got = self.store.batch_get_into(self.keys, self._addresses(self.target), self.sizes)
        seconds = time.perf_counter() - started
        if list(got) != self.sizes:
            raise RuntimeError(f"mooncake: batch_get_into returned {list(got)[:4]}… for {self.sizes[:4]}…")
        total = sum(self.sizes)
        equal = ctypes.string_at(self.source, total) == ctypes.string_at(self.target, total)
        return {"seconds": seconds, "equal": equal}

    def remove(self) -> dict:
        for key in self.keys:
            for _ in range(100):  # an object carries a short lease after a put or get
                if self.store.remove(key) == 0 or not self.store.is_exist(key):
                    break
                time.sleep(0.05)
        self.keys = []
        return {}

    def stop(self) -> None:
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 - the processes below are stopped regardless
            pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main() -> int:
    store = Store()
    try:
        store.start()
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            op = command["op"]
            if op == "quit":
                break
            answer = {"put": lambda: store.put(command["sizes"]), "get": store.get, "remove": store.remove}[op]()
            print(json.dumps(answer), flush=True)
    finally:
        store.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
