"""Where the peer listener binds and the address other daemons dial (``[peers]``, issue 41).

``resolve_peer_address(listen, advertise, redis_url, route=source_address) -> PeerAddress``
— ``host``, ``port`` (what the listener binds), ``advertise`` (``host:port`` the directory
names, or ``""``: the listener's bound address, known once bound), ``note`` (why, for the
start banner). Called once at start by ``daemon.app``; raises ``ConfigError`` naming
``peers.listen`` / ``peers.advertise`` where no address would reach the other daemons.

The other daemons are those that share the Redis directory, so Redis's host decides:

- ``peers.listen`` empty (the default) and Redis on this host (``unix://``, or a host that
  resolves to loopback addresses only): ``127.0.0.1:0``, advertised as bound (one machine).
- ``peers.listen`` empty and Redis elsewhere: every interface on ``DEFAULT_PORT`` (9465),
  advertised as this host's address on its route to Redis (``route``: the source address
  the kernel picks for a datagram socket connected to Redis; no packet is sent). A daemon
  that reaches that Redis is on a network where that address is most likely reachable.
- ``peers.listen`` a wildcard (``0.0.0.0``, ``::``, empty host) without ``peers.advertise``:
  advertised as the route's address with the listen port (port 0 refused: the address
  must be known before binding).
- ``peers.listen`` on a loopback address, Redis elsewhere, no ``peers.advertise``: refused
  (the other hosts would dial their own loopback).
- ``peers.advertise`` set: used as is.

The listener is open only to daemons that prove they hold the cluster keyring
(docs/operations.md, "Daemon-to-daemon authentication"); listening on every interface
exposes that handshake, never an object.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from statetier.protocol.errors import ConfigError

DEFAULT_PORT = 9465
_WILDCARDS = {"", "0.0.0.0", "::", "*"}


@dataclass(frozen=True, slots=True)
class PeerAddress:
    host: str
    port: int
    advertise: str
    note: str


def source_address(host: str, port: int) -> str:
    """This host's address on its route to ``host:port`` (no packet is sent)."""
    family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(where)
        return str(probe.getsockname()[0])


def redis_endpoint(redis_url: str) -> tuple[str, int] | None:
    """Redis's host and port, or None where it is on this host by construction (unix://)."""
    parts = urlsplit(redis_url)
    if parts.scheme == "unix":
        return None
    return parts.hostname or "localhost", parts.port or 6379


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return host == "localhost"
    return bool(found) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in found)


def joined(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_peer_address(listen: str, advertise: str, redis_url: str,
                         route: Callable[[str, int], str] = source_address) -> PeerAddress:
    """See the module docstring."""
    endpoint = redis_endpoint(redis_url)
    remote = endpoint is not None and not is_loopback(endpoint[0])
    if not listen:
        if endpoint is None or not remote:
            return PeerAddress("127.0.0.1", 0, advertise, "loopback: Redis is on this host, so are the other daemons")
        host, port = _route(endpoint, route), DEFAULT_PORT
        return PeerAddress("::" if ":" in host else "0.0.0.0", port, advertise or joined(host, port),
                           f"every interface, advertised as this host's address toward Redis {endpoint[0]}")
    bind, _, port_text = listen.rpartition(":")
    bind, port = bind.strip("[]"), int(port_text)
    if advertise:
        return PeerAddress(bind, port, advertise, "peers.advertise")
    if bind in _WILDCARDS:
        if port == 0:
            raise ConfigError(f"peers.listen {listen!r}: a wildcard host needs a fixed port (the address other "
                              f"daemons dial is named before binding), or set peers.advertise")
        host = _route(endpoint, route) if endpoint is not None else "127.0.0.1"
        return PeerAddress(bind, port, joined(host, port), "every interface, advertised as this host's address "
                           "toward Redis")
    if endpoint is not None and remote and is_loopback(bind):
        raise ConfigError(f"peers.listen {listen!r} is this host's loopback, but Redis ({endpoint[0]}) is not: "
                          f"daemons on other hosts would dial their own loopback. Leave peers.listen unset "
                          f"(every interface on port {DEFAULT_PORT}, advertised as this host's address), or set "
                          f"peers.listen = \"0.0.0.0:PORT\", or peers.advertise = \"HOST:PORT\" (an address the "
                          f"other daemons can dial; 127.0.0.1:PORT if they all run on this host)")
    return PeerAddress(bind, port, "", "peers.listen")


def _route(endpoint: tuple[str, int], route: Callable[[str, int], str]) -> str:
    try:
        return route(*endpoint)
    except OSError as exc:
        raise ConfigError(f"peers.advertise: cannot tell this host's address toward Redis ({endpoint[0]}: {exc}); "
                          f"set peers.advertise = \"HOST:{DEFAULT_PORT}\" to an address the other daemons can dial "
                          f"(in Kubernetes: the pod IP, from status.podIP)") from exc
