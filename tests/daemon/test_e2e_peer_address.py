"""End to end: peers reachable from other hosts when Redis is (issue 41 item 3).

A redis-server bound to loopback and to this host's non-loopback address, the daemons given
the latter as redis.url (Redis "elsewhere"). ``peers.enabled = true`` alone: the listener
on every interface, port 9465, advertised as this host's address toward Redis — printed in
the start banner and returned by ``stats``; a second daemon pulls a published object by
that address. ``peers.listen`` on loopback: the start is refused, naming the setting; so is
a peer port another process holds (not a traceback).
Skipped where this host has no non-loopback address (no route).
"""

from __future__ import annotations

import contextlib
import socket

import pytest

from statetier.clients import Client
from statetier.daemon.peer_address import DEFAULT_PORT, source_address
from statetier.launch import DaemonFailed, DaemonProcess, RedisServer, free_port
from tests.support.jamba import assert_same_tensors, jamba_namespace, snapshot
from tests.support.keyrings import keyring_file

SPEC = jamba_namespace("peer-address")
PREFIX = bytes(range(32))


def this_hosts_address() -> str:
    try:
        address = source_address("192.0.2.123", 9)  # any routed address: no packet is sent
    except OSError:
        pytest.skip("no route off this host")
    if address.startswith("127.") or ":" in address:
        pytest.skip(f"this host's route address is {address}")
    return address


def port_is_free(port: int) -> bool:
    with contextlib.closing(socket.socket()) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def remote_redis():
    address = this_hosts_address()
    server = RedisServer().start(extra_args=["--bind", f"127.0.0.1 {address}"])
    try:
        yield address, f"redis://{address}:{server.port}/0"
    finally:
        server.close()


def peer_stats(daemon: DaemonProcess) -> dict:
    with Client(daemon.url) as client:
        (peer,) = [t for t in client.stats()["tiers"] if t["tier"] == "peer"]
    return peer["extra"]


def test_peers_enabled_alone_advertises_this_hosts_address_and_a_peer_pulls_by_it(remote_redis) -> None:
    address, url = remote_redis
    automatic = port_is_free(DEFAULT_PORT)
    prefill_settings = {"peers.enabled": "true"} if automatic else \
        {"peers.enabled": "true", "peers.listen": f"0.0.0.0:{free_port()}"}
    with keyring_file() as keyring, \
            DaemonProcess(name="prefill", redis_url=url, keyring=keyring, settings=prefill_settings) as prefill, \
            DaemonProcess(name="decode", redis_url=url, keyring=keyring,
                          settings={"peers.enabled": "true", "peers.listen": f"0.0.0.0:{free_port()}"}) as decode:
        advertised = peer_stats(prefill)["address"]
        port = DEFAULT_PORT if automatic else int(prefill_settings["peers.listen"].rpartition(":")[2])
        assert advertised == f"{address}:{port}"
        banner = prefill.log_text()
        assert f"  peers: other daemons dial {address}:{port} (listening on 0.0.0.0:{port}: every interface" in banner
        with Client(prefill.url, namespace=SPEC) as client:
            ref = client.put_ssm(1, PREFIX, 64, snapshot(5), request_id="r", publish=True)
        with Client(decode.url, namespace=SPEC) as client:
            assert_same_tensors(client.load(ref), snapshot(5))
        assert decode.counters().get("hits peer") == 1


def test_a_loopback_peer_listener_with_redis_elsewhere_is_refused(remote_redis) -> None:
    _, url = remote_redis
    daemon = DaemonProcess(name="loopback", redis_url=url, settings={"peers.enabled": "true",
                                                                     "peers.listen": "127.0.0.1:0"})
    try:
        with pytest.raises(DaemonFailed, match=r"exited with 2"):
            daemon.start()
        assert "peers.listen '127.0.0.1:0' is this host's loopback" in daemon.log_text()
    finally:
        daemon.close()


def test_a_peer_port_in_use_is_a_start_refusal_naming_peers_listen(fresh_redis) -> None:
    with contextlib.closing(socket.socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = DaemonProcess(name="taken", redis_url=fresh_redis.url,
                               settings={"peers.enabled": "true", "peers.listen": f"127.0.0.1:{port}"})
        try:
            with pytest.raises(DaemonFailed, match=r"exited with 2"):
                daemon.start()
            assert f"error: config: peers.listen: cannot listen on 127.0.0.1:{port}" in daemon.log_text()
        finally:
            daemon.close()
