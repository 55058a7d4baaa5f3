"""The Redis tier: sealed objects in Redis or Redis Cluster, shared by every node.

``RedisTier`` / ``RedisTierOptions`` (``tier.py``, ``options.py``) and
``RedisVersionRegistry`` (``registry.py``, the version registry across nodes) are all the
daemon touches. Inside:

- ``medium`` — the client and every call through it (the seam of every part), the
  accounting, what this node saw stored.
- ``stores`` / ``loads`` / ``lookup`` / ``removal`` / ``evict`` — the parts ``RedisTier``
  is composed of, each over the tier's ``Ledger`` and its medium: the manifest-last commit;
  leases, prefetch and verified reads; ``find_by_keys`` in two round trips; delete and the
  erase; LRU eviction.
- ``layout`` — key names and the chunk layout (manifest, chunks under one hash tag).
- ``connect`` — the client (single node or Cluster), one-round-trip ``exchange``.
- ``scripts`` — the Lua scripts (manifest-last commit, accounting, LRU).
- ``errors`` — what redis-py raises, as statetier errors.
"""

from .options import RedisTierOptions
from .registry import RedisVersionRegistry
from .tier import RedisTier

__all__ = ["RedisTier", "RedisTierOptions", "RedisVersionRegistry"]
