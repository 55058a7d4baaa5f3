"""What every part of the engine works against: the tier hierarchy and its accounts.

- ``EngineOptions``  — lease TTL, producer id, tenant quotas, write-behind bound, promotion on
                       load, and whether a put may ``publish`` without a cross-node tier
- ``Stack``          — built once by ``Engine``, handed to its parts (``daemon.engine.puts``,
                       ``daemon.engine.fencing``, ``daemon.engine.loads``, ``daemon.engine.serving``,
                       ``daemon.engine.candidates``, ``daemon.engine.deletion``, ``daemon.engine.lookup``,
                       ``daemon.engine.audit``, ``daemon.engine.catalog``): the tiers fastest first,
                       the host arena, where a publish goes (``Publishing``: the
                       cross-node tier, the shared Redis tier, its purge marks), the version registry,
                       ``Placement``, ``Tenancy``, keyring, options, metrics (``Metrics``, or
                       ``NullMetrics`` when the engine has none) and the KV
                       events' ``Announcements`` (or None);
                       ``run_work(nbytes, fn)`` runs copies and digests on the loop below
                       ``protocol.thresholds.INLINE_WORK_BYTES``, else as one executor
                       job; ``count_rejection`` / ``count_skip`` /
                       ``count_miss`` count a refusal (and say it at INFO, once per
                       reason per interval: ``refusal_log``), a skipped candidate, a miss.

Not a value: its fields are fixed once built (a frozen dataclass: no part rebinds them), but
what they name is live and shared — the tiers, ``Placement`` and ``Tenancy`` change as the
parts work through them. The parts share these collaborators and nothing else; the lookup
and the audit get the stack too, never the ``Engine``.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from statetier.protocol.errors import StatetierError
from statetier.protocol.identity import StateKey
from statetier.protocol.keyring import Keyring
from statetier.protocol.thresholds import run_work
from statetier.tiers.base import Tier
from statetier.tiers.registry import VersionRegistry

from ..metrics import Metrics, NullMetrics
from .announcements import Announcements
from .placement import Placement
from .publishing import Publishing
from .purge_marks import PurgeMarks
from .refusal_log import RefusalLog
from .tenancy import Tenancy

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    lease_ttl: float = 30.0
    producer_id: str = ""
    quotas: dict = field(default_factory=dict)  # tenant -> {tier name -> bytes}
    write_behind_limit: int = 256
    promote_on_load: bool = True
    #: a put with ``publish`` and no cross-node tier: refused (False) or stored locally,
    #: said in the reply and counted (True)
    tolerate_unpublished: bool = False


@dataclass(frozen=True, slots=True)
class Stack:
    tiers: list[Tier]
    keyring: Keyring
    registry: VersionRegistry
    options: EngineOptions
    placement: Placement
    tenancy: Tenancy
    metrics: Metrics | NullMetrics = field(default_factory=NullMetrics)
    arena: Tier | None = None
    publishing: Publishing = field(default_factory=Publishing)
    executor: Executor | None = None
    announcements: Announcements | None = None
    #: the cluster's purge marks, honoured before what is located is served (``purge_marks``)
    purges: PurgeMarks | None = None
    refusals: RefusalLog = field(default_factory=RefusalLog)

    async def run_work(self, nbytes: int, fn: Callable[[], T]) -> T:
        return await run_work(self.executor, nbytes, fn)

    def count_rejection(self, exc: StatetierError, state_id: bytes | None = None) -> None:
        """A refused object (``state_id``, when the caller knows it): counted, and logged."""
        self.metrics.count_rejection(exc.reason)
        self.refusals.note(exc, state_id)

    def count_skip(self, reason: str) -> None:
        self.metrics.count_skipped_candidate(reason)

    def count_miss(self, key: StateKey) -> None:
        self.metrics.count_miss(key.kind.name.lower())
