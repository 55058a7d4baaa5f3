"""What the disk tier is configured with.

- ``DiskTierOptions(directory, capacity_bytes, …)`` — a frozen value, checked when made
  (``ConfigError``): the directory, the live bytes it may hold, segment size, watermarks,
  compaction threshold, lease TTL (on ``clock``), fsync, checkpoint cadence, the most bytes
  one eviction reads, the eviction policy (``LruPolicy``); ``free_space_reserve`` is derived
  (2 segments, between 1 and 64 MiB).
- ``EVICTION_BATCH_BYTES`` — the default of ``eviction_batch_bytes``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

from statetier.protocol.errors import ConfigError

from ..base import Clock
from ..eviction import EvictionPolicy, LruPolicy
from .records import RECORD_HEADER_BYTES

# One eviction reads its victims into memory (to hand them to the tier below): it takes at
# most this many bytes per call, not the whole band down to the low watermark — 15 % of a
# 16 GiB tier would be 2.4 GiB at once. The next store over the high watermark takes more.
EVICTION_BATCH_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class DiskTierOptions:
    """See the module docstring."""

    directory: Path
    capacity_bytes: int
    _: KW_ONLY
    segment_bytes: int = 64 << 20
    high_watermark: float = 0.9
    low_watermark: float = 0.75
    compact_below_live_ratio: float = 0.5
    lease_ttl: float = 30.0
    fsync: bool = True
    name: str = "disk"
    checkpoint_ops: int = 4096
    checkpoint_seconds: float = 2.0
    eviction_batch_bytes: int = EVICTION_BATCH_BYTES
    clock: Clock = field(default=time.monotonic, repr=False, compare=False)
    #: makes the order eviction takes objects in (``tiers.eviction``): least recently used first
    eviction_policy: Callable[[], EvictionPolicy] = field(default=LruPolicy, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.segment_bytes <= RECORD_HEADER_BYTES:
            raise ConfigError("disk tier needs a positive capacity and segments larger than a record header")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError("disk tier watermarks need 0 < low <= high <= 1")
        object.__setattr__(self, "directory", Path(self.directory))

    @property
    def free_space_reserve(self) -> int:
        """Bytes a store must leave free on the filesystem, for COMMIT records and index pages."""
        return max(1 << 20, min(2 * self.segment_bytes, 64 << 20))
