"""statetier.tiers — where sealed objects live: device, host, disk and Redis.

- ``base``       — the ``Tier`` interface, ``ObjectMeta``, ``StoreTicket``, ``Lease``,
                   ``LeaseTable``, ``LruIndex``, ``TierStats``, ``EvictedObject``
- ``registry``   — ``VersionRegistry`` and its in-process implementation
- ``crypto``     — ``AtRestCipher``: AES-GCM envelopes for the disk and Redis tiers
- ``allocator``, ``host``, ``device`` — the shared-memory arena tier and the torch pool
- ``allocator``/``extent_tier``/``rawmemory`` — the arena allocator and the shared
                   bookkeeping of the host and device tiers
- ``disk``       — append-only segments (the log) + an LMDB index (its checkpoint),
                   crash-safe, compacting (``segments``, ``disk_log``, ``disk_index``,
                   ``disk_checkpoint``, ``disk_space``, ``disk_commit``, ``disk_recovery``,
                   ``disk_compaction``, ``disk_jobs``, ``disk_body``)
- ``redis``, ``redis_registry`` — Redis / Redis Cluster tier and the cross-node registry
                   (``redis_layout``, ``redis_connect``, ``redis_errors``)

Only the daemon's composition root names concrete tier classes.
"""
