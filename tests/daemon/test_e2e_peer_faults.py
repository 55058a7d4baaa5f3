"""End to end: the wire faults between a prefill and a decode daemon (issue 40).

Real processes: a redis-server, two ``statetier serve`` daemons with one keyring, and
``launch.tcp_proxy.DelayProxy`` between them as prefill's ``peers.advertise`` (decode dials
the proxy, the proxy prefill's listener). After each transient fault between the two live
daemons the next load of a published object succeeds on its first try (counted: no retry),
the load in flight during the fault is answered (a typed error, never a hang, never wrong
bytes) and decode fences nothing (``statetier_peer_owners_fenced`` 0):

- the proxy drops its connections (an idle timeout, a middlebox, a NIC flap) → the pooled
  connection is redialled (``statetier_peer_faults_total{reason="redialled"}``), between two
  loads or under one in flight (which is then served);
- the proxy stalls past the pull's deadline → ``PeerLost`` within it, prefill only
  ``suspected`` (it renews its liveness key);
- one byte of the transfer flipped → refused where it lands (``corrupt_payload``), pulled again;
- Redis restarted without its data → prefill publishes its entries again (``reannounced``).

And a dead owner behind the proxy (the proxy hides the refused dial) is fenced once its
liveness key expired (``fenced_gone``): its entries are no longer offered.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import redis

from statetier.clients import Client
from statetier.launch import DaemonProcess, free_port
from statetier.launch.tcp_proxy import DelayProxy
from statetier.protocol.errors import NotFound, PeerLost, StatetierError
from tests.support.jamba import assert_same_tensors, jamba_namespace, snapshot
from tests.support.keyrings import keyring_file
from tests.support.peer_daemons import peer_daemon
from tests.support.waiting import wait_until

SPEC = jamba_namespace("peer-faults")
PREFIX = bytes(range(32))
PEERS = {"peers.enabled": "true", "peers.pull_timeout_seconds": 1.0, "peers.liveness_ttl_seconds": 1.0}


def daemon(name: str, redis_url: str, keyring, **settings):
    return peer_daemon(name, redis_url, keyring, PEERS, **settings)


@contextlib.contextmanager
def pd_behind_proxy(redis_url: str, prefill_liveness: float = 10.0):
    """prefill (its listener behind the proxy, its liveness key outliving any stall here),
    decode, and the proxy."""
    port = free_port()
    with keyring_file() as keyring, DelayProxy(port) as proxy, \
            daemon("prefill", redis_url, keyring, **{"peers.listen": f"127.0.0.1:{port}",
                                                     "peers.advertise": f"127.0.0.1:{proxy.port}",
                                                     "peers.liveness_ttl_seconds": prefill_liveness}) as prefill, \
            daemon("decode", redis_url, keyring) as decode:
        yield prefill, decode, proxy


def put_published(owner: DaemonProcess, seed: int):
    with Client(owner.url, namespace=SPEC) as client:
        return [client.put_ssm(layer, PREFIX, 64, snapshot(seed + layer), request_id="r", publish=True)
                for layer in (1, 3, 5)]


def faults(daemon: DaemonProcess) -> dict[str, float]:
    scraped = daemon.scrape()
    counted = {dict(labels)["reason"]: v for labels, v in scraped.matching("statetier_peer_faults_total").items()}
    return {**counted, "owners_fenced": scraped.value("statetier_peer_owners_fenced", tier="peer")}


def load(daemon: DaemonProcess, ref):
    with Client(daemon.url, namespace=SPEC) as client:
        return client.load(ref)


def object_size(redis_url: str, ref) -> int:
    with contextlib.closing(redis.Redis.from_url(redis_url)) as r:
        return int(msgspec.msgpack.decode(r.get(f"st:peer:obj:{ref.state_id.hex()}"))[7])


def test_dropped_connections_are_redialled_and_the_next_load_succeeds_at_once(fresh_redis):
    with pd_behind_proxy(fresh_redis.url) as (prefill, decode, proxy):
        refs = put_published(prefill, seed=10)
        assert_same_tensors(load(decode, refs[0]), snapshot(11))  # a pooled connection now idles
        proxy.drop()
        assert_same_tensors(load(decode, refs[1]), snapshot(13))
        counted = faults(decode)
        assert (counted["redialled"], counted["retried"], counted["owners_fenced"]) == (1, 0, 0)
        assert proxy.dropped >= 1


def test_connections_dropped_under_a_load_in_flight_are_redialled_and_it_is_served(fresh_redis):
    with pd_behind_proxy(fresh_redis.url) as (prefill, decode, proxy):
        refs = put_published(prefill, seed=60)
        assert_same_tensors(load(decode, refs[0]), snapshot(61))
        proxy.hold()
        received = proxy.received
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(load, decode, refs[1])
            wait_until(lambda: proxy.received > received, "the pull request reached the proxy")
            proxy.drop()  # the request is lost with its connection
            proxy.release()
            assert_same_tensors(in_flight.result(timeout=30), snapshot(63))
        counted = faults(decode)
        assert (counted["redialled"], counted["owners_fenced"]) == (1, 0)


def test_a_stall_past_the_deadline_answers_the_load_in_flight_and_the_next_one_succeeds(fresh_redis):
    with pd_behind_proxy(fresh_redis.url) as (prefill, decode, proxy):
        refs = put_published(prefill, seed=20)
        assert_same_tensors(load(decode, refs[0]), snapshot(21))
        proxy.hold()
        try:
            with pytest.raises(PeerLost):  # within peers.pull_timeout_seconds: a miss, never a hang
                load(decode, refs[1])
        finally:
            proxy.release()
        before = faults(decode)
        assert_same_tensors(load(decode, refs[1]), snapshot(23))
        after = faults(decode)
        assert (after["suspected"], after["owners_fenced"]) == (1, 0)
        assert after["retried"] == before["retried"] and after["redialled"] == before["redialled"]


def test_a_flipped_byte_is_refused_where_it_lands_and_pulled_again(fresh_redis):
    with pd_behind_proxy(fresh_redis.url) as (prefill, decode, proxy):
        refs = put_published(prefill, seed=30)
        assert_same_tensors(load(decode, refs[0]), snapshot(31))
        answer_head = 9  # status(1) length(8), then the sealed object
        proxy.flip_next(answer_head + object_size(fresh_redis.url, refs[1]) - 17)  # in the payload's last bytes
        assert_same_tensors(load(decode, refs[1]), snapshot(33))  # refused where it landed, pulled again
        assert decode.scrape().value("statetier_rejections_total", reason="corrupt_payload") == 1
        assert proxy.flipped == 1
        assert_same_tensors(load(decode, refs[2]), snapshot(35))
        assert faults(decode)["owners_fenced"] == 0


def test_redis_restarted_empty_gets_the_owners_entries_again(fresh_redis):
    with pd_behind_proxy(fresh_redis.url) as (prefill, decode, proxy):
        refs = put_published(prefill, seed=40)
        fresh_redis.stop()
        with pytest.raises(StatetierError):  # the load during the outage: a typed answer
            load(decode, refs[0])
        fresh_redis.start(fresh_redis.port)  # no persistence: empty
        wait_until(lambda: faults(prefill)["reannounced"] >= 1, "prefill announced its entries again")
        assert_same_tensors(load(decode, refs[0]), snapshot(41))
        assert_same_tensors(load(decode, refs[2]), snapshot(45))
        assert faults(decode)["owners_fenced"] == 0


def test_a_dead_owner_behind_a_proxy_is_fenced_once_its_liveness_key_expired(fresh_redis):
    with pd_behind_proxy(fresh_redis.url, prefill_liveness=1.5) as (prefill, decode, proxy):
        refs = put_published(prefill, seed=50)
        prefill.kill()  # the proxy still accepts, then closes: no refusal reaches decode
        with contextlib.closing(redis.Redis.from_url(fresh_redis.url)) as r:
            wait_until(lambda: len(list(r.scan_iter("st:peer:alive:*"))) == 1, "prefill's liveness key expired")
        with pytest.raises(PeerLost):
            load(decode, refs[0])
        counted = faults(decode)
        assert (counted["fenced_gone"], counted["owners_fenced"]) == (1, 1)
        with pytest.raises(NotFound):  # not offered: no second wait on it
            load(decode, refs[1])
