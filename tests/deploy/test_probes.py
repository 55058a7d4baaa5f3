"""The sidecar manifest's probes, run as the kubelet runs them, against a real daemon through
a real Redis outage (issue 41 item 2).

A pod is Ready only when every container is, so a statetier readiness that fails while Redis
is down takes every inference pod out of its Service, although the daemon serves its own
copies meanwhile. Here: the ``livenessProbe`` and ``readinessProbe`` of
deploy/kubernetes/sidecar.yaml (path, ``periodSeconds``, ``timeoutSeconds``,
``failureThreshold``) are polled at their periods against a daemon (launch/) with a Redis
tier; the test's redis-server is stopped, and for longer than ``failureThreshold ×
periodSeconds`` after the daemon saw it go (``statetier_redis_up`` 0) neither probe fails
once. The front door's ``/readyz/strict`` with the same settings would have taken the pod
out (and does say 503). Redis restarted: both readiness paths 200 again.
"""

from __future__ import annotations

import http.client
import time
from dataclasses import dataclass, field

from statetier.launch import DaemonProcess, RedisServer
from tests.support.deploy_files import DEPLOY, load_yaml_documents, pod_specs
from tests.support.waiting import wait_until


@dataclass
class Probe:
    """One httpGet probe: success is a 200–399 answer within ``timeoutSeconds``."""

    kind: str
    path: str
    period: float
    timeout: float
    failure_threshold: int
    results: list[tuple[float, int | None]] = field(default_factory=list)
    due: float = 0.0

    @classmethod
    def of(cls, kind: str, spec: dict, path: str | None = None) -> "Probe":
        return cls(kind, path or spec["httpGet"]["path"], float(spec.get("periodSeconds", 10)),
                   float(spec.get("timeoutSeconds", 1)), int(spec.get("failureThreshold", 3)))

    def run(self, port: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=self.timeout)
        try:
            connection.request("GET", self.path)
            status: int | None = connection.getresponse().status
        except OSError:
            status = None
        finally:
            connection.close()
        self.results.append((time.monotonic(), status))
        self.due = time.monotonic() + self.period

    def failed(self, since: float = 0.0) -> list[tuple[float, int | None]]:
        return [(at, status) for at, status in self.results
                if at >= since and (status is None or not 200 <= status < 400)]

    def most_consecutive_failures(self, since: float) -> int:
        most = run = 0
        for at, status in self.results:
            if at >= since:
                run = run + 1 if status is None or not 200 <= status < 400 else 0
                most = max(most, run)
        return most


def sidecar_probes() -> dict[str, dict]:
    documents = load_yaml_documents(DEPLOY / "kubernetes" / "sidecar.yaml")
    (container,) = [c for _, spec in pod_specs(documents) for c in spec["containers"] if c["name"] == "statetier"]
    return {kind: container[kind] for kind in ("livenessProbe", "readinessProbe")}


def poll(probes: list[Probe], port: int, until: float) -> None:
    while time.monotonic() < until:
        for probe in probes:
            if time.monotonic() >= probe.due:
                probe.run(port)
        time.sleep(0.05)


def test_the_sidecars_probes_never_fail_through_a_redis_outage() -> None:
    manifest = sidecar_probes()
    assert manifest["readinessProbe"]["httpGet"]["path"] == "/readyz"
    probes = [Probe.of(kind, spec) for kind, spec in manifest.items()]
    readiness = probes[-1]
    front_door = Probe.of("front door", manifest["readinessProbe"], path="/readyz/strict")
    with RedisServer() as redis, DaemonProcess(name="probes", redis_url=redis.url,
                                               settings={"redis.probe_interval_seconds": 0.5}) as daemon:
        port = daemon.metrics_port
        assert port is not None
        poll([*probes, front_door], port, time.monotonic() + readiness.period)
        assert [p.failed() for p in (*probes, front_door)] == [[], [], []]
        redis.stop()
        wait_until(lambda: daemon.scrape().value("statetier_redis_up") == 0 and
                   daemon.http_get("/readyz")[1].startswith(b"degraded"), "the daemon sees the outage",
                   timeout=15.0)
        down = time.monotonic()
        window = readiness.failure_threshold * readiness.period + readiness.period
        poll([*probes, front_door], port, down + window)
        for probe in probes:
            assert probe.failed() == [], f"{probe.kind} {probe.path} failed during the Redis outage"
            assert len([at for at, _ in probe.results if at >= down]) >= window // probe.period
        assert front_door.most_consecutive_failures(down) >= readiness.failure_threshold
        redis.restart()
        wait_until(lambda: daemon.http_get("/readyz/strict")[0] == 200 and daemon.http_get("/readyz") ==
                   (200, b"ready\n"), "ready again once Redis answers", timeout=15.0)
