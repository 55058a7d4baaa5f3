"""End to end: a configuration mistake never destroys what is stored (issue 27, items 1–2).

- Two daemons given one disk directory: the second refuses to start with exit 2 and
  ``disk.directory … is in use by pid <first>``, leaves no socket behind, and every put the
  first acknowledged as durable loads back after the first restarts.
- Two daemons on one real redis-server with different keyrings (the producer's from
  ``statetier keygen``, the consumer's generated at its start): the consumer warns at start
  that daemons sharing Redis must share ``keys.keyring_file``; its loads of the producer's
  published refs — by ref, by key and after a lookup — are refused as ``UnknownKey`` naming
  ``keys.keyring_file``, counted as ``reason="unknown_key"``, and not one key leaves Redis:
  the producer (and any daemon with its keyring) still loads all ten. With
  ``keys.new_keyring_with_redis = "refuse"`` such a daemon does not start and writes no keyring.
"""

from __future__ import annotations

import pytest

from statetier.clients import Client
from statetier.launch.daemons import DaemonFailed, DaemonProcess
from statetier.protocol.errors import UnknownKey
from statetier.protocol.keyring import Keyring
from tests.support.jamba import assert_same_tensors, jamba_namespace, snapshot

SPEC = jamba_namespace("misconfiguration")


def test_a_second_daemon_on_a_disk_directory_in_use_refuses_to_start_naming_the_first(tmp_path) -> None:
    shared = tmp_path / "shared-disk"
    first = DaemonProcess(name="first", settings={"disk.directory": shared})
    second = DaemonProcess(name="second", settings={"disk.directory": shared})
    try:
        first.start()
        with Client(first.url, namespace=SPEC) as client:
            refs = [client.put_ssm(layer, bytes(32), 64, snapshot(layer), request_id="r", durable=True)
                    for layer in range(10)]
        assert all(ref.durable for ref in refs)
        with pytest.raises(DaemonFailed, match="exited with 2"):
            second.start()
        assert f"disk.directory {shared} is in use by pid {first.pid}" in second.log_text()
        assert not second.socket_path.exists()
        first.restart()
        with Client(first.url, namespace=SPEC) as client:
            for layer, ref in enumerate(refs):
                assert_same_tensors(client.load(ref), snapshot(layer))
    finally:
        second.close()
        first.close()


def redis_keys(redis_server) -> set[bytes]:
    with redis_server.client() as redis_client:
        return set(redis_client.scan_iter(match="st:*", count=1000))


def test_a_daemon_with_another_keyring_refuses_shared_redis_state_and_deletes_none_of_it(tmp_path, redis_server) -> None:
    shared_keyring = tmp_path / "keyring.json"
    Keyring.generate().save(shared_keyring)
    spec = jamba_namespace("misconfigured-keyring")
    producer = DaemonProcess(name="producer", redis_url=redis_server.url, keyring=shared_keyring)
    consumer = DaemonProcess(name="consumer", redis_url=redis_server.url)  # generates a keyring of its own
    try:
        producer.start()
        with Client(producer.url, namespace=spec) as client:
            refs = [client.put_ssm(layer, bytes([layer]) * 32, 64, snapshot(layer), request_id="handoff", publish=True)
                    for layer in range(10)]
        assert all(ref.published for ref in refs)
        stored = redis_keys(redis_server)
        consumer.start()
        assert "must share one keyring (keys.keyring_file)" in consumer.log_text()
        before = consumer.scrape()
        with Client(consumer.url, namespace=spec) as client:
            for ref in refs:
                with pytest.raises(UnknownKey, match="keys.keyring_file"):
                    client.load(ref)
            with pytest.raises(UnknownKey):
                client.load(refs[0].key)
        assert consumer.scrape().delta(before, "statetier_rejections_total", reason="unknown_key") == 11
        assert redis_keys(redis_server) >= stored  # not one key of the producer's left Redis
        with Client(producer.url, namespace=spec) as client:
            for layer, ref in enumerate(refs):
                assert_same_tensors(client.load(ref), snapshot(layer))
    finally:
        consumer.close()
        producer.close()


def test_refuse_stops_a_daemon_that_would_generate_a_keyring_beside_redis(redis_server) -> None:
    daemon = DaemonProcess(name="refuse", redis_url=redis_server.url,
                           settings={"keys.new_keyring_with_redis": "refuse"})
    try:
        with pytest.raises(DaemonFailed, match="exited with 2"):
            daemon.start()
        assert "daemons that share Redis must share one keyring" in daemon.log_text()
        assert not (daemon.disk_dir / "keyring.json").exists()
    finally:
        daemon.close()
