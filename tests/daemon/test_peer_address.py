"""Where the peer listener binds and what it advertises, from ``[peers]`` and redis.url
(``daemon.peer_address``, issue 41 item 3), and the start banner's peer line.

Regression: ``peers.enabled = true`` alone bound and advertised ``127.0.0.1:<port>`` with
Redis on another host, so a daemon on another machine dialled its own loopback; nothing
said so. The route to Redis is given (``route=``) so that each case is exact; the
end-to-end tests (test_e2e_peer_address.py) take the kernel's real route.
"""

from __future__ import annotations

import pytest

from statetier.daemon.app import peer_banner
from statetier.daemon.config import Config, PeersConfig
from statetier.daemon.config_loading import load_config
from statetier.daemon.peer_address import DEFAULT_PORT, PeerAddress, resolve_peer_address
from statetier.protocol.errors import ConfigError


def route(host: str, port: int) -> str:
    assert (host, port) == ("10.1.2.3", 6379), (host, port)
    return "10.0.0.5"


def no_route(host: str, port: int) -> str:
    raise OSError(101, "Network is unreachable")


@pytest.mark.parametrize("url", ["unix:///run/redis/redis.sock", "redis://127.0.0.1:6379/0", "redis://localhost/0",
                                 "rediss://user:pw@[::1]:6380/0", "redis://127.0.0.2:7000"])
def test_redis_on_this_host_keeps_the_peer_listener_on_loopback(url: str) -> None:
    assert resolve_peer_address("", "", url, route=no_route) == PeerAddress(
        "127.0.0.1", 0, "", "loopback: Redis is on this host, so are the other daemons")


def test_redis_elsewhere_listens_everywhere_and_advertises_the_hosts_address_toward_it() -> None:
    found = resolve_peer_address("", "", "redis://:secret@10.1.2.3:6379/0", route=route)
    assert (found.host, found.port, found.advertise) == ("0.0.0.0", DEFAULT_PORT, f"10.0.0.5:{DEFAULT_PORT}")
    assert "toward Redis 10.1.2.3" in found.note


def test_an_ipv6_route_listens_on_every_ipv6_interface_and_brackets_the_address() -> None:
    found = resolve_peer_address("", "", "redis://10.1.2.3:6379", route=lambda h, p: "fd00::5")
    assert (found.host, found.port, found.advertise) == ("::", DEFAULT_PORT, f"[fd00::5]:{DEFAULT_PORT}")


def test_a_wildcard_listen_is_advertised_with_its_port_and_needs_a_fixed_one() -> None:
    found = resolve_peer_address("0.0.0.0:7000", "", "redis://10.1.2.3:6379", route=route)
    assert (found.host, found.port, found.advertise) == ("0.0.0.0", 7000, "10.0.0.5:7000")
    assert resolve_peer_address("[::]:7000", "", "unix:///r.sock", route=no_route).advertise == "127.0.0.1:7000"
    with pytest.raises(ConfigError, match=r"peers\.listen '0\.0\.0\.0:0'.*fixed port.*peers\.advertise"):
        resolve_peer_address("0.0.0.0:0", "", "redis://10.1.2.3:6379", route=route)


def test_a_loopback_listen_with_redis_elsewhere_is_refused_naming_both_settings() -> None:
    with pytest.raises(ConfigError) as refused:
        resolve_peer_address("127.0.0.1:0", "", "redis://10.1.2.3:6379", route=route)
    assert "peers.listen '127.0.0.1:0'" in refused.value.message and "peers.advertise" in refused.value.message
    # said explicitly, it is the operator's choice (every daemon on this one host)
    found = resolve_peer_address("127.0.0.1:7000", "127.0.0.1:7000", "redis://10.1.2.3:6379", route=route)
    assert (found.host, found.port, found.advertise) == ("127.0.0.1", 7000, "127.0.0.1:7000")


def test_an_explicit_address_binds_there_and_advertises_as_bound() -> None:
    found = resolve_peer_address("10.0.0.5:7000", "", "redis://10.1.2.3:6379", route=no_route)
    assert (found.host, found.port, found.advertise) == ("10.0.0.5", 7000, "")
    found = resolve_peer_address("", "st-0.peers.svc:9465", "redis://10.1.2.3:6379", route=route)
    assert found.advertise == "st-0.peers.svc:9465"


def test_no_route_to_redis_is_refused_naming_peers_advertise() -> None:
    with pytest.raises(ConfigError, match=r"peers\.advertise: cannot tell this host's address toward Redis"):
        resolve_peer_address("", "", "redis://10.1.2.3:6379", route=no_route)


def test_the_defaults_leave_the_choice_to_redis_url_and_advertise_is_checked(tmp_path) -> None:
    assert (PeersConfig().listen, PeersConfig().advertise) == ("", "")
    path = tmp_path / "statetier.toml"
    path.write_text('[redis]\nurl = "redis://10.1.2.3:6379"\n[peers]\nenabled = true\nadvertise = "nohost"\n')
    with pytest.raises(ConfigError, match="peers.advertise"):
        load_config(path, env={})
    assert Config().peers.listen == ""


def test_the_banner_line_says_what_other_daemons_dial_and_where_it_listens() -> None:
    remote = PeerAddress("0.0.0.0", 9465, "10.0.0.5:9465", "every interface, advertised as this host's address")
    assert peer_banner(remote, "10.0.0.5:9465") == (
        "  peers: other daemons dial 10.0.0.5:9465 (listening on 0.0.0.0:9465: every interface, advertised as "
        "this host's address)")
    local = PeerAddress("127.0.0.1", 0, "", "loopback: Redis is on this host, so are the other daemons")
    assert peer_banner(local, "127.0.0.1:40123") == (
        "  peers: other daemons dial 127.0.0.1:40123 (listening on 127.0.0.1 (any free port): loopback: Redis is "
        "on this host, so are the other daemons)")
