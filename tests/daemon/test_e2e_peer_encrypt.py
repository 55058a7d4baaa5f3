"""Encrypted pulls between real daemons (``peers.encrypt``): prefill behind a TCP proxy that
records what it sends, decode asking for its pulls sealed, prefill with the setting off (it
answers sealed when asked: a mixed cluster works).

- the handoff lands the very tensors, and a 64-byte run of them is nowhere on the wire;
- one byte flipped on the wire is a GCM failure: never served, the pull tried again on a fresh
  connection (``statetier_peer_faults_total{reason="retried"}``) and the load served; no
  rejection counted (nothing damaged reached a tier), the owner not fenced.
"""

from __future__ import annotations

import contextlib

from statetier.clients import Client
from statetier.launch import DaemonProcess, free_port
from statetier.launch.tcp_proxy import DelayProxy
from tests.support.jamba import assert_same_tensors, jamba_namespace, snapshot
from tests.support.keyrings import keyring_file
from tests.support.peer_daemons import peer_daemon

SPEC = jamba_namespace("peer-encrypt")
PREFIX = bytes(range(32))
PEERS = {"peers.enabled": "true", "peers.pull_timeout_seconds": 1.0, "peers.liveness_ttl_seconds": 1.0}


def daemon(name: str, redis_url: str, keyring, **settings):
    return peer_daemon(name, redis_url, keyring, PEERS, **settings)


def put_published(owner: DaemonProcess, seed: int):
    with Client(owner.url, namespace=SPEC) as client:
        return [client.put_ssm(layer, PREFIX, 64, snapshot(seed + layer), request_id="r", publish=True)
                for layer in (1, 3, 5)]


def load(daemon: DaemonProcess, ref):
    with Client(daemon.url, namespace=SPEC) as client:
        return client.load(ref)


def faults(daemon: DaemonProcess) -> dict[str, float]:
    scraped = daemon.scrape()
    counted = {dict(labels)["reason"]: v for labels, v in scraped.matching("statetier_peer_faults_total").items()}
    return {**counted, "owners_fenced": scraped.value("statetier_peer_owners_fenced", tier="peer")}


@contextlib.contextmanager
def pd_encrypted(redis_url: str):
    port = free_port()
    with keyring_file() as keyring, DelayProxy(port) as proxy, \
            daemon("prefill", redis_url, keyring, **{"peers.listen": f"127.0.0.1:{port}",
                                                     "peers.advertise": f"127.0.0.1:{proxy.port}",
                                                     "peers.liveness_ttl_seconds": 10.0}) as prefill, \
            daemon("decode", redis_url, keyring, **{"peers.encrypt": "true"}) as decode:
        yield prefill, decode, proxy


def test_an_encrypted_handoff_hides_the_bytes_and_a_flipped_byte_is_pulled_again(fresh_redis):
    with pd_encrypted(fresh_redis.url) as (prefill, decode, proxy):
        refs = put_published(prefill, seed=70)
        proxy.record()
        assert_same_tensors(load(decode, refs[0]), snapshot(71))
        recorded = proxy.recorded
        assert recorded is not None and len(recorded) > snapshot(71)["ssm"].numel() * 4  # the object went by
        raw = snapshot(71)["ssm"].numpy().tobytes()
        assert not any(raw[at : at + 64] in recorded for at in (0, 4096, len(raw) - 64))
        proxy.flip_next(2 * 9 + 200)  # past a PULL_MANY's heads or a PULL's: in the ciphertext either way
        assert_same_tensors(load(decode, refs[1]), snapshot(73))  # refused before it landed, pulled again
        assert proxy.flipped == 1 and faults(decode)["retried"] == 1
        assert not decode.scrape().value("statetier_rejections_total", reason="corrupt_payload")
        assert_same_tensors(load(decode, refs[2]), snapshot(75))
        assert faults(decode)["owners_fenced"] == 0
