"""End to end: Redis is a tier, not a dependency of the local path (issue 35 items 1–5).

A daemon subprocess (host, disk, a real redis-server that the tests kill, SIGSTOP and
restart). Bounded waits (``wait_until``, generous limits) for what the health probe does in
the background; no timing assertion beyond "within N s" of a change.

- Redis killed: ``statetier_redis_up`` goes 0, ``/readyz`` stays 200 with a ``degraded`` body
  naming what is served (degraded is still ready), and ``/readyz/strict`` answers 503; loads of local copies (by ref and by key), lookups and local puts
  are served — never a version older than one this daemon acknowledged —, each counted in ``statetier_outage_served_total{op}``; a put with publish is
  refused (``RegistryUnavailable``) and leaves nothing; Redis restarted without its data:
  up and ready again, and the outage's claim is written back (the only head there).
- Redis frozen (SIGSTOP): the same, and a load in flight costs at most the call deadline.
- Started with Redis down: degraded, then ready once Redis answers (the default); with
  ``redis.start_unreachable = "refuse"`` it exits 2 naming ``redis.url``.
- A published put gets a disk copy too (write-behind), so it outlives Redis; a publish whose
  claim meets the outage before the probe finds it is refused with nothing stored.
- Two daemons, one cut off from Redis (a held proxy): the version it claimed locally, taken
  by the other in Redis first, is lost on reconnect, and its object refused as stale.
"""

from __future__ import annotations

import os
import signal

import pytest

from statetier.clients import Client
from statetier.launch.daemons import DaemonFailed, DaemonProcess
from statetier.launch.processes import free_port
from statetier.launch.redis_servers import RedisServer
from statetier.launch.tcp_proxy import DelayProxy
from statetier.protocol.errors import RegistryUnavailable, StaleState
from statetier.tiers.tolerant_registry import OUTAGE_STRIDE
from tests.support.daemons import daemon_fixture
from tests.support.jamba import assert_same_tensors, jamba_namespace, kv_page, snapshot
from tests.support.keyrings import keyring_file
from tests.support.waiting import wait_until

SPEC = jamba_namespace("outage")
PREFIX = bytes(range(32))
SETTINGS = {"redis.socket_timeout": 2.0, "redis.probe_interval_seconds": 0.5}
WITHIN_S = 10.0  # "within 5 s" of the issue, doubled for a busy machine


@pytest.fixture
def daemon(request, fresh_redis):
    return daemon_fixture(request, name="outage", redis_url=fresh_redis.url, settings=SETTINGS)


def redis_up(daemon) -> float:
    return daemon.scrape().value("statetier_redis_up")


def wait_degraded(daemon) -> bytes:
    def degraded():
        status, body = daemon.http_get("/readyz")
        strict, strict_body = daemon.http_get("/readyz/strict")
        return body if (status, strict) == (200, 503) and body.startswith(b"degraded") and strict_body == body \
            and redis_up(daemon) == 0 else None

    return wait_until(degraded, "readyz degraded and redis_up 0", timeout=WITHIN_S)


def wait_ready(daemon) -> None:
    wait_until(lambda: daemon.http_get("/readyz") == daemon.http_get("/readyz/strict") == (200, b"ready\n")
               and redis_up(daemon) == 1, "readyz and readyz/strict 200 and redis_up 1", timeout=WITHIN_S)


def served(daemon, op: str) -> float:
    return daemon.scrape().value("statetier_outage_served_total", op=op)


def local_ops_are_served(daemon, client: Client, kv_ref, ssm_ref) -> object:
    """Loads by ref and by key, a lookup and a local put during the outage; the new ref."""
    assert_same_tensors(client.load(kv_ref), kv_page(1, 64))
    assert_same_tensors(client.load(ssm_ref.key), snapshot(2))
    found = client.lookup([0], [1], [(64, PREFIX)], kv_layout="prefix", lease=False)
    assert found.tokens == 64
    new = client.put_ssm(1, PREFIX, 64, snapshot(3), request_id="r")
    assert new.version == ssm_ref.version + OUTAGE_STRIDE  # ahead of any claim still on its way to Redis
    assert_same_tensors(client.load(new), snapshot(3))
    with pytest.raises(StaleState):  # the staleness promise holds through the outage
        client.load(ssm_ref)
    assert_same_tensors(client.load(ssm_ref.key), snapshot(3))  # by key: the newest this daemon holds
    with pytest.raises(RegistryUnavailable):
        client.put_kv(0, PREFIX, 64, 128, kv_page(4, 64), request_id="r", publish=True)
    assert (served(daemon, "load"), served(daemon, "put"), served(daemon, "lookup")) >= (3, 1, 1)
    return new


def test_redis_killed_local_ops_are_served_and_the_restart_reconciles(daemon, fresh_redis) -> None:
    with Client(daemon.url, namespace=SPEC) as client:
        kv_ref = client.put_kv(0, PREFIX, 0, 64, kv_page(1, 64), request_id="r")
        ssm_ref = client.put_ssm(1, PREFIX, 64, snapshot(2), request_id="r")
        wait_ready(daemon)
        fresh_redis.kill()
        body = wait_degraded(daemon)
        assert b"served: loads and lookups" in body and b"refused: puts with publish=true" in body
        new = local_ops_are_served(daemon, client, kv_ref, ssm_ref)
        fresh_redis.start(fresh_redis.port)  # killed: restarted empty
        wait_ready(daemon)
        with fresh_redis.client() as raw:
            heads = list(raw.scan_iter(match="st:v:*"))
            assert len(heads) == 1 and int(raw.hget(heads[0], "version")) == new.version
        assert_same_tensors(client.load(new), snapshot(3))
        published = client.put_kv(0, PREFIX, 64, 128, kv_page(4, 64), request_id="r", publish=True)
        assert_same_tensors(client.load(published), kv_page(4, 64))


def test_redis_frozen_local_ops_are_served_and_readiness_follows(daemon, fresh_redis) -> None:
    with Client(daemon.url, namespace=SPEC) as client:
        kv_ref = client.put_kv(0, PREFIX, 0, 64, kv_page(1, 64), request_id="r")
        ssm_ref = client.put_ssm(1, PREFIX, 64, snapshot(2), request_id="r")
        os.kill(fresh_redis.pid, signal.SIGSTOP)
        try:
            wait_degraded(daemon)
            local_ops_are_served(daemon, client, kv_ref, ssm_ref)
        finally:
            os.kill(fresh_redis.pid, signal.SIGCONT)
        wait_ready(daemon)


def test_a_daemon_started_with_redis_down_is_degraded_then_ready(request) -> None:
    port = free_port()
    daemon = daemon_fixture(request, name="late-redis", redis_url=f"redis://127.0.0.1:{port}/0", settings=SETTINGS)
    wait_degraded(daemon)
    with Client(daemon.url, namespace=SPEC) as client:
        ref = client.put_ssm(1, PREFIX, 64, snapshot(5), request_id="r")
        assert_same_tensors(client.load(ref), snapshot(5))
        with RedisServer().start(port):
            wait_ready(daemon)
            published = client.put_ssm(1, PREFIX, 64, snapshot(6), request_id="p", publish=True)
            assert_same_tensors(client.load(published), snapshot(6))


def test_refuse_to_start_without_redis_names_the_field() -> None:
    daemon = DaemonProcess(name="refuse-redis", redis_url=f"redis://127.0.0.1:{free_port()}/0",
                           settings={**SETTINGS, "redis.start_unreachable": "refuse"})
    try:
        with pytest.raises(DaemonFailed, match="exited with 2"):
            daemon.start()
        assert "redis.url" in daemon.log_text() and 'redis.start_unreachable = "refuse"' in daemon.log_text()
    finally:
        daemon.close()


def test_a_published_put_gets_a_disk_copy_and_outlives_redis(daemon, fresh_redis) -> None:
    with Client(daemon.url, namespace=SPEC) as client:
        ref = client.put_ssm(1, PREFIX, 64, snapshot(7), request_id="r", publish=True)
        wait_until(lambda: client.list_objects()["namespaces"][0]["tiers"].get("disk", {}).get("objects") == 1,
                   "the write-behind copy on disk", timeout=WITHIN_S)
    daemon.stop()
    fresh_redis.kill()
    daemon.start()
    with Client(daemon.url, namespace=SPEC) as client:
        assert_same_tensors(client.load(ref), snapshot(7))


def test_a_publish_whose_claim_meets_the_outage_is_refused_before_anything_is_stored(request, fresh_redis) -> None:
    """Before the probe finds Redis frozen (it probes once a minute here): the claim waits its
    deadline, is made from this daemon's view, and the publish is refused, nothing stored."""
    daemon = daemon_fixture(request, name="half-publish", redis_url=fresh_redis.url,
                            settings={"redis.socket_timeout": 1.0, "redis.probe_interval_seconds": 60})
    with Client(daemon.url, namespace=SPEC) as client:
        os.kill(fresh_redis.pid, signal.SIGSTOP)
        try:
            with pytest.raises(RegistryUnavailable, match="nothing was stored or published"):
                client.put_ssm(1, PREFIX, 64, snapshot(8), request_id="r", publish=True)
            assert client.list_objects()["namespaces"] == []
            local = client.put_ssm(1, PREFIX, 64, snapshot(9), request_id="r")
            # ahead of the refused publish's claim, which the frozen server still makes when it wakes
            assert local.version == OUTAGE_STRIDE
            assert_same_tensors(client.load(local), snapshot(9))
        finally:
            os.kill(fresh_redis.pid, signal.SIGCONT)


def test_an_outage_put_another_daemon_beat_is_refused_as_stale_after_the_reconnect(request, fresh_redis) -> None:
    """Prefill cut off from Redis (a held proxy) puts a stream's next version locally; decode,
    still on Redis, puts the same version of that stream first. On reconnect prefill's claim is
    lost to decode's, and a load by ref of prefill's object is refused (``StaleState``)."""
    with keyring_file() as keyring, DelayProxy(fresh_redis.port) as proxy:
        prefill = daemon_fixture(request, name="cut-off", redis_url=proxy.url, keyring=keyring, settings=SETTINGS)
        decode = daemon_fixture(request, name="on-redis", redis_url=fresh_redis.url, keyring=keyring,
                                settings=SETTINGS)
        with Client(prefill.url, namespace=SPEC) as cut_off, Client(decode.url, namespace=SPEC) as on_redis:
            proxy.hold()
            wait_degraded(prefill)
            mine = cut_off.put_ssm(1, PREFIX, 64, snapshot(10), request_id="race")
            theirs = on_redis.put_ssm(1, PREFIX, 64, snapshot(11), request_id="race", version=mine.version)
            assert theirs.version == mine.version
            proxy.release()
            wait_ready(prefill)
            assert "1 lost to newer ones" in prefill.log_text()
            with pytest.raises(StaleState):
                cut_off.load(mine)
            assert_same_tensors(on_redis.load(theirs), snapshot(11))
