"""The Redis tier: sealed objects in Redis or Redis Cluster, shared by every node.

``RedisTier`` (``tier.py``) and ``RedisVersionRegistry`` (``registry.py``, the version
registry across nodes) are all the daemon touches. Inside:

- ``store`` / ``load`` / ``lookup`` / ``evict`` — the parts ``RedisTier`` is composed of:
  the manifest-last commit; leases, prefetch and verified reads; ``find_by_keys`` in two
  round trips; delete, LRU eviction and the erase.

- ``layout`` — key names and the chunk layout (manifest, chunks under one hash tag).
- ``connect`` — the client (single node or Cluster), one-round-trip ``exchange``.
- ``scripts`` — the Lua scripts (manifest-last commit, accounting, LRU).
- ``verify`` — integrity of what was read (signature, payload digest), header cache.
- ``errors`` — what redis-py raises, as statetier errors.
"""

from .registry import RedisVersionRegistry
from .tier import RedisTier

__all__ = ["RedisTier", "RedisVersionRegistry"]
