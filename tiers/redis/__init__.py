"""The Redis tier: sealed objects in Redis or Redis Cluster, shared by every node.

``RedisTier`` (``tier.py``) and ``RedisVersionRegistry`` (``registry.py``, the version
registry across nodes) are all the daemon touches. Inside:

- ``layout`` — key names and the chunk layout (manifest, chunks under one hash tag).
- ``connect`` — the client (single node or Cluster), one-round-trip ``exchange``.
- ``scripts`` — the Lua scripts (manifest-last commit, accounting, LRU).
- ``verify`` — integrity of what was read (signature, payload digest), header cache.
- ``errors`` — what redis-py raises, as statetier errors.
"""

from .registry import RedisVersionRegistry
from .tier import RedisTier

__all__ = ["RedisTier", "RedisVersionRegistry"]
