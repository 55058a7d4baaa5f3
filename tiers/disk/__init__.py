"""The disk tier: append-only segment files and an LMDB index, crash-safe, verified on read.

``DiskTier`` and ``DiskTierOptions`` (``tier.py``, ``options.py``) are all the daemon
touches. Inside:

- ``volume`` — the medium: the directory while started (``OpenVolume``: jobs, index, space,
  the group commit, the compactor), opened with recovery and closed with a checkpoint.
- ``stores`` / ``loads`` / ``removal`` — the parts ``DiskTier`` is composed of, each over
  the tier's ``Ledger`` and its volume: reserved record ranges and the group commit; leases
  and verified reads; delete, dropped damage and eviction.
- ``segments`` — one segment file: records, pwritev/preadv, record headers.
- ``index`` — the LMDB index (object → segment, offset, length, generation) and its ops.
- ``body`` — a record's body: at-rest envelope, read and verified (``open_intact``).
- ``space`` — segments, reservations and free space; ``jobs`` — the executor jobs.
- ``commit``, ``log``, ``checkpoint`` — the group commit: fdatasync, then the index.
- ``dirlock`` — the directory's lock: one open tier (one daemon) per directory.
- ``recovery`` — the restart: replay the log tail, rebuild the LRU, drop what is torn.
- ``compaction`` — move live records out of mostly dead segments (never leased ones).
"""

from .options import DiskTierOptions
from .tier import DiskTier

__all__ = ["DiskTier", "DiskTierOptions"]
