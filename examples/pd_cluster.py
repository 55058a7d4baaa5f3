"""The processes behind the PD demo: one Redis, a shared keyring, one statetier daemon per side.

- ``PDCluster(redis_url=None)`` — a context manager. ``start()``: a ``redis-server`` on a free
  port in its own temp dir (unless ``redis_url`` names one), a signing keyring
  (``statetier keygen``), then two daemons (``python -m statetier.daemon serve``), each with
  its own Unix socket, disk dir and metrics port, both with ``--redis-url``; waits until
  both answer a ping. ``close()``: SIGTERM to the daemons, then Redis; removes the dir.
- ``cluster.prefill`` / ``cluster.decode`` — ``Daemon(name, url, metrics_port, log_path)``.
- ``Daemon.counters()`` — bytes per tier and operation, hits per tier and promotions, read
  from its ``/metrics`` (subtract two readings for what one request moved).

The Redis binary is found as the test suite finds it (``tests/support/redis_procs.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0


@dataclass
class Daemon:
    name: str
    url: str
    metrics_port: int
    log_path: Path
    process: subprocess.Popen | None = None

    def counters(self) -> dict[str, int]:
        """What the daemon counted so far: ``"bytes <tier>/<op>"`` (payload bytes per tier and
        operation), ``"hits <tier>"`` (loads served from that tier), ``"promotions <src>-><dst>"``."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        out: dict[str, int] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "statetier_bytes_total":
                    name = f"bytes {labels.get('tier')}/{labels.get('op')}"
                elif sample.name == "statetier_hits_total":
                    name = f"hits {labels.get('tier')}"
                elif sample.name == "statetier_promotions_total":
                    name = f"promotions {labels.get('src')}->{labels.get('dst')}"
                else:
                    continue
                out[name] = out.get(name, 0) + int(sample.value)
        return out


class PDCluster:
    def __init__(self, redis_url: str | None = None) -> None:
        self.redis_url = redis_url
        self.directory: Path | None = None
        self.prefill: Daemon | None = None
        self.decode: Daemon | None = None
        self._redis = None

    def __enter__(self) -> "PDCluster":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def start(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="st-pd-", dir="/tmp"))  # AF_UNIX paths are short
        if self.redis_url is None:
            self._redis = _start_redis()
            self.redis_url = self._redis.url
        keyring = self.directory / "keyring.json"
        subprocess.run([sys.executable, "-m", "statetier.daemon", "keygen", "--out", str(keyring)],
                       cwd=REPO, check=True, capture_output=True)
        self.prefill = self._spawn("prefill", keyring)
        self.decode = self._spawn("decode", keyring)
        for daemon in (self.prefill, self.decode):
            _wait_until_serving(daemon)

    def _spawn(self, name: str, keyring: Path) -> Daemon:
        home = self.directory / name
        home.mkdir()
        daemon = Daemon(name, f"unix://{home / 'd.sock'}", _redis_procs().free_port(), home / "daemon.log")
        command = [sys.executable, "-m", "statetier.daemon", "serve", "--socket", str(home / "d.sock"),
                   "--disk-dir", str(home / "disk"), "--redis-url", self.redis_url, "--keyring", str(keyring),
                   "--metrics-host", "127.0.0.1", "--metrics-port", str(daemon.metrics_port),
                   "--host-capacity", "256MiB"]
        with open(daemon.log_path, "wb") as log:
            daemon.process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        return daemon

    def close(self) -> None:
        for daemon in (self.decode, self.prefill):
            if daemon is not None and daemon.process is not None and daemon.process.poll() is None:
                daemon.process.send_signal(signal.SIGTERM)
                try:
                    daemon.process.wait(30)
                except subprocess.TimeoutExpired:
                    daemon.process.kill()
                    daemon.process.wait()
        if self._redis is not None:
            self._redis.close()
            self._redis = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def _redis_procs():
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from support import redis_procs

    return redis_procs


def _start_redis():
    return _redis_procs().RedisServer().start()


def _wait_until_serving(daemon: Daemon) -> None:
    from statetier.clients import Client

    deadline = time.monotonic() + START_TIMEOUT_S
    socket_path = daemon.url.removeprefix("unix://")
    while time.monotonic() < deadline:
        if daemon.process.poll() is not None:
            raise RuntimeError(f"the {daemon.name} daemon exited with {daemon.process.returncode}:\n"
                               f"{daemon.log_path.read_text()[-4000:]}")
        if os.path.exists(socket_path):
            try:
                with Client(daemon.url, use_shm=False) as probe:
                    probe.ping()
                daemon.counters()
                return
            except Exception:  # noqa: BLE001 - still starting
                pass
        time.sleep(0.1)
    raise RuntimeError(f"the {daemon.name} daemon did not serve {daemon.url} within {START_TIMEOUT_S} s")
