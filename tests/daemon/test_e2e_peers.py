"""End to end: objects pulled from the daemon that holds them, Redis the directory (issue 34).

Real processes throughout: a redis-server on a free port, two or three ``statetier serve``
daemons with ``peers.enabled`` and one keyring, real sockets between them. A publish on
prefill puts a descriptor in Redis (no bytes under the default ``descriptor`` policy);
decode finds it through the directory (by key, by ref) and pulls it from prefill into its
own arena, verified where it lands. Faults: prefill killed (kill -9) before the pull → the
load fails as ``PeerLost`` within the pull's deadline, its address refuses connections, so
decode fences it (the next load is a plain miss: recompute) while its entries stay in the
directory (a puller withdraws nothing); or, under ``descriptor+bytes``, it is served from the
Redis copy. Prefill stopped (SIGSTOP) → ``PeerLost``, only suspected while its liveness key
lives, fenced once it expired, offered again once it runs. A daemon with another keyring
pulls nothing (``Unauthorized``) and fences nothing. A lookup on decode finds the joint hit
of prefill's objects through the directory. (Wire faults through a proxy:
``test_e2e_peer_faults``.) A ``load_many`` on
decode pulls each of its ``LOAD_BATCH`` frames' objects with one request to prefill, and each
pulled byte is copied once on the decode side (daemon and client counted apart).
"""

from __future__ import annotations

import contextlib
import signal

import pytest
import redis

from statetier.clients import Client
from statetier.clients.batches import load_batch_items
from statetier.daemon.cli.formatting import format_stats
from statetier.launch import DaemonProcess, free_port
from statetier.protocol.errors import NotFound, PeerLost, Unauthorized
from tests.support.jamba import assert_same_tensors, jamba_namespace, snapshot
from tests.support.keyrings import keyring_file
from tests.support.peer_daemons import peer_daemon
from tests.support.waiting import wait_until

SPEC = jamba_namespace("peers")
PREFIX = bytes(range(32))
PEERS = {"peers.enabled": "true", "peers.pull_timeout_seconds": 1.0}


def daemon(name: str, redis_url: str, keyring, **settings):
    return peer_daemon(name, redis_url, keyring, PEERS, **settings)


def put_published(owner: DaemonProcess, seed: int = 10):
    with Client(owner.url, namespace=SPEC) as client:
        return [client.put_ssm(layer, PREFIX, 64, snapshot(seed + layer), request_id="r", publish=True)
                for layer in (1, 3)]


def redis_keys(url: str, pattern: str) -> list[bytes]:
    with contextlib.closing(redis.Redis.from_url(url)) as r:
        return sorted(r.scan_iter(pattern))


def data_keys(url: str) -> list[bytes]:
    """What Redis holds besides the directory and the version registry: the Redis tier's copies."""
    return [k for k in redis_keys(url, "st:{*}:m")]


def test_a_published_object_is_pulled_from_its_owner_and_redis_holds_only_its_descriptor(fresh_redis):
    with keyring_file() as keyring, daemon("prefill", fresh_redis.url, keyring) as prefill, \
            daemon("decode", fresh_redis.url, keyring) as decode:
        refs = put_published(prefill)
        assert len(redis_keys(fresh_redis.url, "st:peer:obj:*")) == 2
        assert data_keys(fresh_redis.url) == []  # policy descriptor: no bytes in Redis
        before = decode.counters()
        with Client(decode.url, namespace=SPEC) as client:
            for index, ref in enumerate(refs):
                assert_same_tensors(client.load(ref), snapshot(10 + 2 * index + 1))
        after = decode.counters()
        assert after.get("hits peer", 0) - before.get("hits peer", 0) == 2
        assert after.get("promotions peer->host", 0) - before.get("promotions peer->host", 0) == 2
        assert "hits redis" not in after
        with Client(decode.url, namespace=SPEC) as client:  # promoted: served from decode's arena now
            assert_same_tensors(client.load(refs[0]), snapshot(11))
            printed = format_stats(client.stats())  # what `statetier stats` prints (issue 41)
        assert "  hits: host ssm 1, peer ssm 2" in printed and "  peers: pulls 2, lost 0, owners fenced 0" in printed
        assert decode.counters().get("hits host", 0) - after.get("hits host", 0) == 1


def passes(proc: DaemonProcess) -> tuple[int, int]:
    """Payload bytes the daemon copied and hashed so far (``statetier_payload_pass_bytes_total``)."""
    samples = proc.scrape()
    return tuple(int(samples.value("statetier_payload_pass_bytes_total", op=op)) for op in ("copied", "hashed"))


def test_a_batch_is_one_pull_and_each_pulled_byte_is_copied_once_on_the_decode_side(fresh_redis):
    with keyring_file() as keyring, daemon("prefill", fresh_redis.url, keyring) as prefill, \
            daemon("decode", fresh_redis.url, keyring) as decode:
        with Client(prefill.url, namespace=SPEC) as client:
            refs = [client.put_ssm(layer, PREFIX, 64, snapshot(20 + layer), request_id="b", publish=True)
                    for layer in range(6)]
        payload = sum(t.nbytes for layer in range(6) for t in snapshot(20 + layer).values())
        decode_before, prefill_before = passes(decode), passes(prefill)
        with Client(decode.url, namespace=SPEC) as client:
            for layer, loaded in enumerate(client.load_many(refs)):
                assert_same_tensors(loaded, snapshot(20 + layer))
            (peer,) = [t for t in client.stats()["tiers"] if t["tier"] == "peer"]
        copied, hashed = (a - b for a, b in zip(passes(decode), decode_before))
        # received once (into decode's arena), copied once (into the client's load window: issue 42
        # serves it in place), hashed by none of the daemons (the client verifies where it lands)
        assert payload <= copied < payload + 6 * 4096 and hashed == 0
        assert passes(prefill) == prefill_before  # the owner sends what it holds, as it lies
        with Client(prefill.url, namespace=SPEC) as client:
            (owner,) = [t for t in client.stats()["tiers"] if t["tier"] == "peer"]
        frames = -(-6 // load_batch_items(6))  # the SDK cuts a load_many into pipelined LOAD_BATCH frames
        assert owner["extra"]["pull_batches_answered"] == frames == 2 and owner["extra"]["served"] == 6  # one each
        assert peer["extra"]["pulls_lost"] == 0


def test_a_load_by_key_finds_the_object_on_the_peer_through_the_directory(fresh_redis):
    with keyring_file() as keyring, daemon("prefill", fresh_redis.url, keyring) as prefill, \
            daemon("decode", fresh_redis.url, keyring) as decode:
        put_published(prefill, seed=40)
        with Client(decode.url, namespace=SPEC) as client:
            key = client.ssm_key(3, PREFIX, 64)
            assert_same_tensors(client.load(key), snapshot(43))
        assert decode.counters().get("hits peer", 0) == 1


def faults(daemon: DaemonProcess) -> dict[str, float]:
    scraped = daemon.scrape()
    counted = {dict(labels)["reason"]: v for labels, v in scraped.matching("statetier_peer_faults_total").items()}
    return {**counted, "owners_fenced": scraped.value("statetier_peer_owners_fenced", tier="peer")}


def test_a_killed_owner_is_a_typed_miss_and_fenced_here_its_entries_left_to_their_ttl(fresh_redis):
    with keyring_file() as keyring, daemon("prefill", fresh_redis.url, keyring) as prefill, \
            daemon("decode", fresh_redis.url, keyring) as decode:
        refs = put_published(prefill)
        prefill.kill()  # SIGKILL, then reaped: its port refuses connections
        with Client(decode.url, namespace=SPEC) as client:
            with pytest.raises(PeerLost):  # within peers.pull_timeout_seconds
                client.load(refs[0])
            with pytest.raises(NotFound):  # the owner is fenced here: no second wait on it
                client.load(refs[1])
        counted = faults(decode)
        assert counted["fenced_refused"] == 1 and counted["owners_fenced"] == 1
        assert len(redis_keys(fresh_redis.url, "st:peer:obj:*")) == 2  # withdrawn by their owner or TTL only


def test_a_stopped_owner_is_suspected_fenced_once_its_liveness_key_expired_and_offered_again_when_it_runs(
        fresh_redis):
    with keyring_file() as keyring, \
            daemon("prefill", fresh_redis.url, keyring, **{"peers.liveness_ttl_seconds": 4.5}) as prefill, \
            daemon("decode", fresh_redis.url, keyring, **{"peers.liveness_ttl_seconds": 1.0}) as decode:
        refs = put_published(prefill, seed=30)
        prefill.send_signal(signal.SIGSTOP)
        try:
            with Client(decode.url, namespace=SPEC) as client:
                with pytest.raises(PeerLost):  # its key lives on 3-4.5 s: suspected, not fenced
                    client.load(refs[0])
                assert (faults(decode)["suspected"], faults(decode)["owners_fenced"]) == (1, 0)
                wait_until(lambda: len(redis_keys(fresh_redis.url, "st:peer:alive:*")) == 1,  # decode's only
                           "prefill's liveness key expired")
                with pytest.raises(PeerLost):
                    client.load(refs[0])
                assert (faults(decode)["fenced_gone"], faults(decode)["owners_fenced"]) == (1, 1)
                with pytest.raises(NotFound):  # fenced here: no second wait on it
                    client.load(refs[1])
                stats = format_stats(client.stats())  # two loads lost to it, one owner fenced
                assert "  peers: pulls 0, lost 2, owners fenced 1" in stats
        finally:
            prefill.send_signal(signal.SIGCONT)
        wait_until(lambda: faults(decode)["unfenced"] == 1, "decode saw prefill renew its liveness key")
        with Client(decode.url, namespace=SPEC) as client:
            assert_same_tensors(client.load(refs[1]), snapshot(33))
        assert faults(decode)["owners_fenced"] == 0


def test_descriptor_and_bytes_falls_back_to_the_redis_copy_when_the_owner_dies(fresh_redis):
    with keyring_file() as keyring, \
            daemon("prefill", fresh_redis.url, keyring, **{"peers.policy": "descriptor+bytes"}) as prefill, \
            daemon("decode", fresh_redis.url, keyring) as decode:
        refs = put_published(prefill, seed=20)
        assert data_keys(fresh_redis.url) != []
        prefill.send_signal(signal.SIGKILL)
        with Client(decode.url, namespace=SPEC) as client:
            for index, ref in enumerate(refs):
                assert_same_tensors(client.load(ref), snapshot(20 + 2 * index + 1))
        counted = decode.counters()
        assert counted.get("hits redis", 0) == 2 and counted.get("hits peer", 0) == 0


def test_a_daemon_with_another_keyring_pulls_nothing(fresh_redis):
    with keyring_file() as keyring, keyring_file() as stranger_keys, \
            daemon("prefill", fresh_redis.url, keyring) as prefill, \
            daemon("stranger", fresh_redis.url, stranger_keys) as stranger:
        refs = put_published(prefill)
        with Client(stranger.url, namespace=SPEC) as client:
            with pytest.raises(Unauthorized):
                client.load(refs[0])
        assert stranger.counters().get("hits peer", 0) == 0
        # a stranger's refusal is no sign of a lost owner: nothing fenced
        assert len(redis_keys(fresh_redis.url, "st:peer:obj:*")) == 2


def test_a_lookup_finds_the_joint_hit_on_the_peer(fresh_redis):
    with keyring_file() as keyring, daemon("prefill", fresh_redis.url, keyring) as prefill, \
            daemon("decode", fresh_redis.url, keyring) as decode:
        put_published(prefill, seed=50)
        with Client(decode.url, namespace=SPEC) as client:
            found = client.lookup(ssm_layers=[1, 3], boundaries=[(64, PREFIX)], lease=False)
        assert found.tokens == 64 and len(found.objects) == 2


def test_an_owner_restarted_on_its_address_is_offered_again(fresh_redis):
    listen = {"peers.listen": f"127.0.0.1:{free_port()}"}  # a fixed port, as a deployment has
    with keyring_file() as keyring, daemon("prefill", fresh_redis.url, keyring, **listen) as prefill, \
            daemon("decode", fresh_redis.url, keyring) as decode:
        lost = put_published(prefill, seed=60)
        prefill.kill()
        with Client(decode.url, namespace=SPEC) as client:
            with pytest.raises(PeerLost):
                client.load(lost[0])
        prefill.start()  # the same address, a new process: a new owner id
        fresh = put_published(prefill, seed=70)
        with Client(decode.url, namespace=SPEC) as client:
            assert_same_tensors(client.load(fresh[0]), snapshot(71))
        assert decode.counters().get("hits peer", 0) == 1
