"""The peer tier's options: where this daemon serves its objects, where the directory lives.

``PeerTierOptions`` is checked when made (``ConfigError`` naming the field). ``owner_id``
names this daemon in the directory (its entries, its liveness key); ``advertise``
is the ``host:port`` other daemons dial (the listener's when empty, once bound);
``liveness_ttl`` is how long the liveness key this daemon renews (every third of it) outlives
its last renewal: how soon the others fence it once its process is gone; ``encrypt``: this
daemon's pulls ask for the bytes sealed with AES-GCM (``tiers.peer.sealing``) and refuse an
answer in the clear (its answers are sealed whenever a puller asks, whatever it says). Leases of
pulls expire after ``lease_ttl`` (or the ``ttl`` asked) on ``clock``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from statetier.protocol.errors import ConfigError
from statetier.tiers.base import Clock

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class PeerTierOptions:
    redis_url: str
    owner_id: str
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    advertise: str = ""
    pull_timeout: float = 5.0  # one pull (connect, handshake, the object's bytes) or PeerLost
    ttl_seconds: int | None = 3600  # of a directory entry
    socket_buffer_bytes: int = 8 * MiB
    idle_connections: int = 4  # per owner, kept for the next pull
    lease_ttl: float = 30.0
    liveness_ttl: float = 6.0  # seconds; renewed every third of it
    encrypt: bool = False  # pulls ask for the bytes sealed (AES-GCM) and refuse them in the clear
    clock: Clock = field(default=time.monotonic, repr=False, compare=False)  # what lease deadlines are on

    def __post_init__(self) -> None:
        if not self.owner_id:
            raise ConfigError("peers: owner_id must not be empty")
        if not 0 <= self.listen_port < 65536:
            raise ConfigError(f"peers.listen: port {self.listen_port} is out of range")
        if self.pull_timeout <= 0:
            raise ConfigError("peers.pull_timeout_seconds must be positive")
        if self.liveness_ttl < 0.3:
            raise ConfigError("peers.liveness_ttl_seconds must be at least 0.3")
        if self.socket_buffer_bytes < 64 * 1024:
            raise ConfigError("peers.socket_buffer_bytes must be at least 64 KiB")
