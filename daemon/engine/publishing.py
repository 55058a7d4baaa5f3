"""Where a put's ``publish`` goes, said once by the composition root (``daemon.app``).

``Publishing(target, shared, keeps_bytes, marks)`` — a frozen value the engine's parts read
(``daemon.engine.handoff``: the publish and its extra bytes copy; ``daemon.engine.catalog``:
the cluster's purge marks; ``daemon.engine.serving``: the hint of a miss):

- ``target``      — where a publish is described: the peer tier (a descriptor in the
                    directory) or the Redis tier itself (the bytes); None: no cross-node tier
- ``shared``      — the tier on the shared Redis: ``target`` itself, or the Redis tier beside
                    a peer tier; its copies go with a cluster purge
- ``keeps_bytes`` — with a peer tier as ``target``: the namespaces whose publishes also copy
                    their bytes to ``shared`` (policy ``descriptor+bytes``: a copy outliving
                    this daemon); ``bytes_beside(namespace)`` is that tier, or None
- ``marks``       — where the cluster's purge marks are kept (``tiers.base.PurgeMarkStore``,
                    declared by the Redis tier), or None: no cluster-wide purges
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from statetier.tiers.base import PurgeMarkStore, Tier


def _none(namespace: bytes) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class Publishing:
    target: Tier | None = None
    shared: Tier | None = None
    keeps_bytes: Callable[[bytes], bool] = field(default=_none)
    marks: PurgeMarkStore | None = None

    def bytes_beside(self, namespace: bytes) -> Tier | None:
        """The shared tier a publish of ``namespace`` also copies its bytes to, beside a
        ``target`` that only describes it; None where the publish already is the bytes."""
        shared = self.shared
        if shared is None or shared is self.target or not self.keeps_bytes(namespace):
            return None
        return shared
