"""statetier.tiers — where sealed objects live: device, host, disk and Redis.

- ``base``      — the ``Tier`` interface, ``ObjectMeta``, ``StoreTicket``, ``Lease``,
                  ``LeaseTable``, ``LruIndex``, ``TierStats``, ``EvictedObject``
- ``registry``  — ``VersionRegistry`` and its in-process implementation
- ``crypto``    — ``AtRestCipher``: AES-GCM envelopes for the disk and Redis tiers
- ``allocator`` — ``ExtentAllocator``, for the memory tiers and the daemon's windows
- ``memory``    — ``HostTier`` (a shared-memory arena) and ``DeviceTier`` (a torch pool),
                  both an ``ExtentTier`` (``extent``, ``load``, ``compaction``, ``placement``,
                  ``pins``, ``hostbytes``, ``rawmemory``)
- ``disk``      — ``DiskTier``: append-only segments (the log) + an LMDB index (its
                  checkpoint), crash-safe, compacting (``tier``, ``store``, ``load``,
                  ``segments``, ``index``, ``body``, ``space``, ``jobs``, ``commit``, ``log``,
                  ``checkpoint``, ``recovery``, ``compaction``)
- ``redis``     — ``RedisTier`` on Redis / Redis Cluster and ``RedisVersionRegistry``, the
                  cross-node registry (``tier``, ``store``, ``load``, ``lookup``, ``evict``,
                  ``layout``, ``connect``, ``scripts``, ``verify``, ``errors``, ``registry``)

Only the daemon's composition root names concrete tier classes.
"""
