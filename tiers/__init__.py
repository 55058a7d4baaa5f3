"""statetier.tiers — where sealed objects live: device, host, disk and Redis.

- ``base``       — the ``Tier`` interface, ``ObjectMeta``, ``StoreTicket``, ``Lease``,
                   ``LeaseTable``, ``LruIndex``, ``TierStats``, ``EvictedObject``
- ``registry``   — ``VersionRegistry`` and its in-process implementation
- ``crypto``     — ``AtRestCipher``: AES-GCM envelopes for the disk and Redis tiers
- ``allocator``, ``host``, ``device`` — the shared-memory arena tier and the torch pool
- ``disk``       — append-only segments + an LMDB index, crash-safe, compacting
- ``redis``, ``redis_registry`` — Redis / Redis Cluster tier and the cross-node registry

Only the daemon's composition root names concrete tier classes.
"""
