"""statetier.tiers — where sealed objects live: device and host memory, disk, Redis.

Shared by every tier:

- ``base``      — the ``Tier`` interface, ``ObjectMeta``, ``StoreTicket``, ``Lease``,
                  ``LeaseTable``, ``LruIndex``, ``TierStats``, ``EvictedObject``
- ``registry``  — ``VersionRegistry`` and its in-process implementation
- ``crypto``    — ``AtRestCipher``: AES-GCM envelopes for the disk and Redis tiers
- ``allocator`` — ``ExtentAllocator``: the memory tiers' arenas and the daemon's windows

The families, each a subpackage whose ``__init__`` exports only what the daemon uses:

- ``memory`` — ``HostTier`` (a shared-memory arena only the daemon maps) and
  ``DeviceTier`` (a preallocated torch tensor)
- ``disk``   — ``DiskTier``: append-only segments + an LMDB index, crash-safe, compacting
- ``redis``  — ``RedisTier`` and ``RedisVersionRegistry``: Redis or Redis Cluster, shared
  by every node

Only the daemon's composition root (``daemon/app.py``) names concrete tier classes.
"""
