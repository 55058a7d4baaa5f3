"""A real Prometheus server for the tests, on a free loopback port with its own storage.

- ``PROMETHEUS``, ``PROMTOOL`` — the binaries on PATH, or ``None`` (the tests then skip;
  ``scripts/ensure_prometheus.sh`` installs Debian's package where apt-get can).
- ``PrometheusServer(config, workdir)`` — ``start()`` writes ``config`` (a dict) as YAML,
  runs ``prometheus`` on ``127.0.0.1:<free port>`` and waits for ``/-/ready``; ``stop()``
  sends SIGTERM to that pid (SIGKILL after a bounded wait). A context manager too.
  ``query(expr)`` → the ``result`` list of ``/api/v1/query``; ``api(path)`` → ``data``.

Never the system service: no port 9090, no /var/lib/prometheus.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from statetier.launch.processes import free_port, stop_process
from tests.support.waiting import wait_until

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
SKIP_REASON = ("prometheus/promtool not installed: run `bash scripts/ensure_prometheus.sh` "
               "(installs Debian's prometheus package where apt-get is usable)")


class PrometheusServer:
    def __init__(self, config: dict, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert PROMETHEUS is not None, SKIP_REASON
        config_file = self.workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.port = free_port()
        self._log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_file}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        wait_until(self._is_ready, "prometheus /-/ready", timeout=60, interval=0.25)

    def _is_ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def log_tail(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def api(self, path: str, **params: str) -> object:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        """The single sample of an instant query, or None when it returns nothing."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def by_label(self, expr: str, *labels: str) -> dict[tuple, float]:
        return {tuple(item["metric"].get(name, "") for name in labels): float(item["value"][1])
                for item in self.query(expr)}

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, 30)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "PrometheusServer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
