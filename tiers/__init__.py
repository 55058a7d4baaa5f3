"""statetier.tiers — where sealed objects live: device, host, disk and Redis.

- ``base``      — the ``Tier`` interface and its values: ``ObjectMeta``, ``StoreTicket``,
                  ``Lease``, ``KeyMatches``, ``TierStats``, ``EvictedObject``
- ``ledger``    — ``Ledger``: the one bookkeeping object of a tier (what it holds, leases,
                  is storing, deleted under a lease; its counters), with ``LeaseTable``
                  and ``LruIndex``; every part of a tier receives it
- ``registry``  — ``VersionRegistry`` and its in-process implementation
- ``crypto``    — ``AtRestCipher``: AES-GCM envelopes for the disk and Redis tiers
- ``memory``    — ``HostTier`` (a shared-memory arena) and ``DeviceTier`` (a torch pool):
                  an ``ExtentTier`` over their medium, of parts ``stores``, ``loads``,
                  ``removal``, ``compaction`` (extents from ``protocol.extents``)
- ``disk``      — ``DiskTier``: append-only segments (the log) + an LMDB index (its
                  checkpoint), crash-safe, compacting; its medium a ``DiskVolume``, its
                  parts ``stores``, ``loads``, ``removal``
- ``redis``     — ``RedisTier`` on Redis / Redis Cluster and ``RedisVersionRegistry``, the
                  cross-node registry; its medium a ``RedisMedium``, its parts ``stores``,
                  ``loads``, ``lookup``, ``removal``, ``evict``

Every tier is made from a frozen options value (``HostTierOptions``, ``DeviceTierOptions``,
``DiskTierOptions``, ``RedisTierOptions``) and its runtime collaborators (keyring, cipher,
executor). Only the daemon's composition root names concrete tier classes.
"""
