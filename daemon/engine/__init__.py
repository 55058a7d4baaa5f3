"""The engine: the tier hierarchy behind the daemon's requests (DESIGN §3–6).

``Engine`` (``engine.py``) is the one entry point the server's handlers call; it is
composed from the parts below, each of which works against a ``Stack`` (``stack.py``: the
tiers, the arena, the registry, placement, tenancy, keyring, options, metrics).

- ``puts`` — seal, claim a version, place, publish, make durable.
- ``fencing`` — the version registry's claims and what a load expects of a stream.
- ``loads`` — a load by ref or by key: copies fastest first, each judged by ``serving``.
- ``serving`` — one leased copy: classify, promote (or read straight into the arena), hold.
- ``candidates`` — the servable objects under a key, newest first.
- ``lookup`` — the joint hit over attention and SSM layers and every TP shard.
- ``leases`` — leases held for callers; ``deletion`` — deletes and dropped damaged copies.
- ``placement`` — where an object goes, eviction, demotion, write-behind, moves.
- ``tenancy`` — namespace ownership and per-tier quotas; ``audit`` — inspect and verify.
- ``announcements`` — the KV events of every copy charged to or given back by a tier.
- ``publishing`` — where a publish goes: the cross-node tier, the shared Redis tier, its purge marks.
"""

from .announcements import Announcements
from .engine import Engine
from .publishing import Publishing
from .stack import EngineOptions

__all__ = ["Announcements", "Engine", "EngineOptions", "Publishing"]
