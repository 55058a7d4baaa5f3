"""The disk tier: append-only segment files and an LMDB index, crash-safe, verified on read.

``DiskTier`` (``tier.py``) is all the daemon touches. Inside:

- ``store`` / ``load`` — the parts ``DiskTier`` is composed of: reserved record ranges and
  the group commit; leases and verified reads.
- ``segments`` — one segment file: records, pwritev/preadv, record headers.
- ``index`` — the LMDB index (object → segment, offset, length, generation) and its ops.
- ``body`` — a record's body: at-rest envelope, read and verified (``open_intact``).
- ``space`` — segments, reservations and free space; ``jobs`` — the executor jobs.
- ``commit``, ``log``, ``checkpoint`` — the group commit: fdatasync, then the index.
- ``dirlock`` — the directory's lock: one open tier (one daemon) per directory.
- ``recovery`` — the restart: replay the log tail, rebuild the LRU, drop what is torn.
- ``compaction`` — move live records out of mostly dead segments (never leased ones).
"""

from .tier import DiskTier

__all__ = ["DiskTier"]
