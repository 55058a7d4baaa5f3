"""What the Redis tier is configured with.

- ``RedisTierOptions(url, …)`` — a frozen value, checked when made (``ConfigError``): the
  server (``cluster=None`` detects a Cluster at start), the key prefix every node sharing
  objects uses, chunk size, TTL (None: no expiry), the byte budget (None: none) and its
  watermarks, lease TTL (on ``clock``), socket timeout (also the deadline of one call, every
  retry included) and retries, what a start without an answering server does, and the
  health probe's timeout.
"""

from __future__ import annotations

import time
from typing import Literal
from dataclasses import KW_ONLY, dataclass, field

from statetier.protocol.errors import ConfigError

from ..base import Clock
from .layout import CHUNK_BYTES


@dataclass(frozen=True, slots=True)
class RedisTierOptions:
    """See the module docstring."""

    url: str
    _: KW_ONLY
    cluster: bool | None = None
    key_prefix: str = "st"
    chunk_bytes: int = CHUNK_BYTES
    ttl_seconds: int | None = None
    capacity_bytes: int | None = None
    high_watermark: float = 0.9
    low_watermark: float = 0.75
    lease_ttl: float = 30.0
    socket_timeout: float = 5.0
    retries: int = 3
    #: a server that does not answer at start: "refuse" (``start`` raises ``Unavailable``) or
    #: "degraded" (started without it; ``probe`` connects once it answers)
    start_unreachable: Literal["refuse", "degraded"] = "refuse"
    probe_timeout: float = 1.5
    name: str = "redis"
    clock: Clock = field(default=time.monotonic, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1:
            raise ConfigError("chunk_bytes must be positive")
        if self.ttl_seconds is not None and self.ttl_seconds < 1:
            raise ConfigError("ttl_seconds must be at least 1 (or None for no expiry)")
        if self.capacity_bytes is not None and self.capacity_bytes < 1:
            raise ConfigError("capacity_bytes must be positive (or None for no budget)")
        if self.socket_timeout <= 0 or self.probe_timeout <= 0:
            raise ConfigError("socket_timeout and probe_timeout must be positive")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError("watermarks need 0 < low_watermark <= high_watermark <= 1")
