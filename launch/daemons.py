"""A statetier daemon as a real subprocess (``python -m statetier.daemon serve``).

Used by the tests, the benchmarks, the examples and the reliability harness: the one place
that knows how to start, wait for, signal and clean up a daemon.

- ``DaemonProcess(config=None, *, host_capacity, redis_url, settings, metrics, name,
  keyring, log_level, directory, group)`` — one daemon in a directory (by default its own short
  temp directory under /tmp, made by the first ``start()``: AF_UNIX paths are short):
  socket ``d.sock``, disk tier ``disk/``, log ``daemon.log``. ``config`` (a dict) is written
  as ``config.toml`` there and passed with ``--config``; ``settings`` become ``--set
  KEY=VALUE`` flags; ``keyring`` a ``--keyring`` file; ``group`` a gid to run it with (a
  service group: what it creates belongs to that group). ``start()`` returns once
  ``/readyz`` answers 200 or degraded (the metrics server starts after the listeners; without metrics:
  once PING answers), else raises ``DaemonFailed`` with the log tail; ``stop(sig=SIGTERM)``
  → exit code; ``send_signal``/``wait``; ``kill()`` (SIGKILL); ``start()`` again, or
  ``restart()``, runs on the same directory; ``close()`` stops it and removes the
  directory it made. A context manager.
- Facts: ``url``, ``socket_path``, ``disk_dir``, ``pid``, ``metrics_port``, ``log_tail()``,
  ``rss_bytes()`` (VmRSS from /proc). A killed daemon leaves nothing behind to clean: its
  host arena is a memfd that goes with the process (a named one, ``host.shm_dir``, the
  next daemon removes at start).
- Metrics: ``http_get(path)`` → ``(status, body)``; ``scrape()`` → ``Samples`` (parsed with
  prometheus_client's parser); ``Samples.value(name, **labels)`` (0.0 when absent),
  ``Samples.delta(before, name, **labels)``; ``counters()`` the bytes per tier and
  operation, hits per tier and promotions, and ``served_by_tier(before, after)`` the loads
  each tier served between two ``counters()`` readings.
- ``to_toml(mapping)`` — the small TOML subset the config needs (tables, arrays of tables).
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Mapping

from prometheus_client.parser import text_string_to_metric_families

from statetier.clients import Client

START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
_LOG_TAIL_CHARS = 6000


class DaemonFailed(RuntimeError):
    """The daemon exited, or did not serve (or stop) in time; the message ends with its log."""


class DaemonProcess:
    """One ``statetier serve`` subprocess; see the module docstring."""

    def __init__(self, config: Mapping[str, Any] | None = None, *, host_capacity: str | None = "128MiB",
                 redis_url: str | None = None, settings: Mapping[str, object] | None = None,
                 metrics: bool = True, name: str = "d", keyring: Path | None = None,
                 log_level: str | None = None, directory: Path | None = None, group: int | None = None) -> None:
        self.name = name
        self.group = group
        self.directory: Path | None = Path(directory) if directory is not None else None
        self._owns_directory = directory is None
        self.keyring = keyring
        self.log_level = log_level
        self.config = dict(config or {})
        self.host_capacity = host_capacity
        self.redis_url = redis_url
        self.settings = dict(settings or {})
        self.has_metrics = metrics
        self.metrics_port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None
        self._log_offset = 0

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def socket_path(self) -> Path:
        return self._here() / "d.sock"

    @property
    def disk_dir(self) -> Path:
        return self._here() / "disk"

    @property
    def log_path(self) -> Path:
        return self._here() / "daemon.log"

    def _here(self) -> Path:
        if self.directory is None:
            raise RuntimeError("the daemon has no directory before start()")
        return self.directory

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "statetier.daemon", "serve", "--socket", str(self.socket_path),
                "--disk-dir", str(self.disk_dir)]
        if self.config:
            argv += ["--config", str(self._here() / "config.toml")]
        argv += ["--metrics-port", "0"] if self.has_metrics else ["--no-metrics"]
        if self.host_capacity is not None:
            argv += ["--host-capacity", self.host_capacity]
        if self.redis_url is not None:
            argv += ["--redis-url", self.redis_url]
        if self.keyring is not None:
            argv += ["--keyring", str(self.keyring)]
        if self.log_level is not None:
            argv += ["--log-level", self.log_level]
        for key, value in self.settings.items():
            argv += ["--set", f"{key}={value}"]
        return argv

    def start(self, timeout: float = START_TIMEOUT) -> "DaemonProcess":
        if self.is_running:
            raise RuntimeError("the daemon is already running")
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix=f"st-{self.name}-", dir="/tmp"))
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.config:
            (self.directory / "config.toml").write_text(to_toml(self.config))
        self.metrics_port = None
        log = self._log = open(self.log_path, "ab")
        self._log_offset = self.log_path.stat().st_size
        log.write(f"--- starting: {' '.join(self.command())}\n".encode())
        log.flush()
        env = {k: v for k, v in os.environ.items() if not k.startswith("STATETIER_")}
        groups: dict[str, Any] = {} if self.group is None else {"group": self.group, "extra_groups": [self.group]}
        self.proc = subprocess.Popen(self.command(), cwd=self.directory, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, **groups)
        try:
            self._wait_until_serving(timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_until_serving(self, timeout: float) -> None:
        """Ready = /readyz answers 200 (the metrics server starts after the listeners), or
        without metrics, a PING over the socket answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._started().poll() is not None:
                raise DaemonFailed(f"the daemon exited with {self._started().returncode}:\n{self.log_tail()}")
            if self._is_serving():
                return
            time.sleep(0.05)
        raise DaemonFailed(f"the daemon did not serve {self.url} within {timeout} s:\n{self.log_tail()}")

    def _is_serving(self) -> bool:
        if self.has_metrics:
            self.metrics_port = self.metrics_port or self._printed_metrics_port()
            if self.metrics_port is None:
                return False
            try:
                status, body = self.http_get("/readyz", timeout=5.0)
            except OSError:
                return False
            # degraded (Redis unreachable) still serves what is local: started
            return (status == 200 or body.startswith(b"degraded")) and self.socket_path.exists()
        try:
            with Client(self.url, use_shm=False, timeout=5.0) as probe:
                probe.ping()
            return True
        except Exception:  # noqa: BLE001 - still starting
            return False

    def _printed_metrics_port(self) -> int | None:
        text = self.log_path.read_bytes()[self._log_offset:].decode(errors="replace")
        for line in text.splitlines():
            marker = "metrics: http://"
            if marker in line:
                return int(line.split(marker, 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        return None

    def _started(self) -> subprocess.Popen[bytes]:
        if self.proc is None:
            raise RuntimeError("the daemon was never started")
        return self.proc

    def send_signal(self, sig: int) -> None:
        self._started().send_signal(sig)

    def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        try:
            code = self._started().wait(timeout)
        except subprocess.TimeoutExpired:
            raise DaemonFailed(f"the daemon did not exit within {timeout} s:\n{self.log_tail()}") from None
        self._close_log()
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT) -> int:
        """Signal the daemon and wait for it; its exit code."""
        if self.proc is None:
            raise RuntimeError("the daemon was never started")
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_log()

    def restart(self) -> "DaemonProcess":
        """SIGTERM (exit 0 asserted), then a new process on the same directory."""
        if self.is_running:
            code = self.stop()
            if code != 0:
                raise DaemonFailed(f"the daemon exited with {code}:\n{self.log_tail()}")
        return self.start()

    def close(self) -> None:
        if self.is_running:
            try:
                self.stop(timeout=STOP_TIMEOUT)
            except DaemonFailed:
                self.kill()
        self._close_log()
        if self.directory is not None and self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "DaemonProcess":
        return self.start() if not self.is_running else self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- facts ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int:
        return self._started().pid

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except (FileNotFoundError, RuntimeError):
            return "(no log)"

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        return self.log_text()[-chars:]

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise DaemonFailed("no VmRSS in /proc/<pid>/status")

    # -- metrics -------------------------------------------------------------------------

    def http_get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.metrics_port, timeout=timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def scrape(self) -> "Samples":
        status, body = self.http_get("/metrics")
        if status != 200:
            raise DaemonFailed(f"/metrics answered {status}: {body[:200]!r}")
        return Samples.parse(body.decode())

    def counters(self) -> dict[str, int]:
        """What the daemon counted so far: ``"bytes <tier>/<op>"`` (payload bytes per tier and
        operation), ``"hits <tier>"`` (loads served from that tier), ``"promotions <src>-><dst>"``
        (subtract two readings for what one request moved)."""
        names = {"statetier_bytes_total": lambda lb: f"bytes {lb.get('tier')}/{lb.get('op')}",
                 "statetier_hits_total": lambda lb: f"hits {lb.get('tier')}",
                 "statetier_promotions_total": lambda lb: f"promotions {lb.get('src')}->{lb.get('dst')}"}
        out: dict[str, int] = {}
        for (sample, labels), value in self.scrape().values.items():
            if sample in names:
                name = names[sample](dict(labels))
                out[name] = out.get(name, 0) + int(value)
        return out


@dataclass(frozen=True)
class Samples:
    """One scrape: ``{(sample name, sorted label items): value}``."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @classmethod
    def parse(cls, text: str) -> "Samples":
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return cls(values)

    def value(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def delta(self, before: "Samples", name: str, **labels: str) -> float:
        return self.value(name, **labels) - before.value(name, **labels)

    def matching(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {labels: v for (n, labels), v in self.values.items() if n == name}


def served_by_tier(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Loads each tier served between two ``DaemonProcess.counters()`` readings."""
    return {name.split()[1]: after[name] - before.get(name, 0) for name in after
            if name.startswith("hits ") and after[name] - before.get(name, 0)}


# -- TOML ------------------------------------------------------------------------------


def to_toml(mapping: Mapping[str, Any]) -> str:
    """Scalars, lists of scalars, nested tables and arrays of tables (``[[tenants]]``)."""
    lines: list[str] = []
    _emit_table(lines, (), mapping)
    return "\n".join(lines) + "\n"


def _emit_table(lines: list[str], path: tuple[str, ...], mapping: Mapping[str, Any]) -> None:
    tables: list[tuple[str, Any, bool]] = []
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            tables.append((key, value, False))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
            tables.append((key, value, True))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, value, is_array in tables:
        here = (*path, key)
        if is_array:
            for item in value:
                lines.append(f"[[{'.'.join(here)}]]")
                _emit_table(lines, here, item)
        else:
            lines.append(f"[{'.'.join(here)}]")
            _emit_table(lines, here, value)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        text = str(value).replace("\\", "\\\\").replace('"', '\\"')
        return f'"{text}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {type(value).__name__}")
