"""The daemons behind the serving workloads: ``examples/pd_cluster.py`` with a chosen arena size.

- ``BenchCluster(host_capacity, redis_url=None)`` — a ``PDCluster`` (Redis on a free port,
  a shared keyring, a prefill and a decode daemon, each with host + disk + Redis tiers and
  a metrics port) whose daemons get ``--host-capacity host_capacity``: one request of
  Qwen3-Next at 8k tokens is 266 MiB, more than the demo's 256 MiB arena.
- ``Daemon.counters()`` (from ``PDCluster``) gives bytes and hits per tier;
  ``served_by_tier(before, after)`` the loads each tier served between two readings;
  ``hits_by_tier_and_kind(daemon)`` the daemon's ``statetier_hits_total`` per (tier, kind).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "examples") not in sys.path:
    sys.path.insert(0, str(REPO / "examples"))

from pd_cluster import Daemon, PDCluster, _redis_procs  # noqa: E402

__all__ = ["BenchCluster", "Daemon", "hits_by_tier_and_kind", "served_by_tier"]


def served_by_tier(before: dict, after: dict) -> dict[str, int]:
    """Loads each tier served between two ``Daemon.counters()`` readings (``"hits <tier>"``)."""
    return {name.split()[1]: after[name] - before.get(name, 0) for name in after
            if name.startswith("hits ") and after[name] - before.get(name, 0)}


def hits_by_tier_and_kind(daemon: Daemon) -> dict[tuple[str, str], int]:
    """Loads served so far by each tier, per kind (``kv``, ``ssm``): one metrics scrape."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[tuple[str, str], int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "statetier_hits_total":
                name = (sample.labels.get("tier"), sample.labels.get("kind"))
                out[name] = out.get(name, 0) + int(sample.value)
    return out


class BenchCluster(PDCluster):
    def __init__(self, host_capacity: str, redis_url: str | None = None) -> None:
        super().__init__(redis_url)
        self.host_capacity = host_capacity

    def _spawn(self, name: str, keyring: Path) -> Daemon:
        home = self.directory / name
        home.mkdir()
        daemon = Daemon(name, f"unix://{home / 'd.sock'}", _redis_procs().free_port(), home / "daemon.log")
        command = [sys.executable, "-m", "statetier.daemon", "serve", "--socket", str(home / "d.sock"),
                   "--disk-dir", str(home / "disk"), "--redis-url", self.redis_url, "--keyring", str(keyring),
                   "--metrics-host", "127.0.0.1", "--metrics-port", str(daemon.metrics_port),
                   "--host-capacity", self.host_capacity, "--log-level", "warning"]
        with open(daemon.log_path, "wb") as log:
            daemon.process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        return daemon
