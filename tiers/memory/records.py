"""What an extent tier records about each object, store and lease, and what compaction reports.

- ``ObjectExtent``     — where one visible object lives: offset, size, generation (changes
                         whenever it moves), LRU stamp. ``Lease.location`` is its
                         ``(offset, generation)``.
- ``PendingStore``     — ``StoreTicket.location`` of a store in progress: its extent, and
                         whether a write is running or failed (then only
                         ``complete_store(success=False)`` may follow).
- ``LeaseState``       — the views a lease's ``read`` handed out (released at
                         ``complete_load``) and the staging buffers behind them.
- ``ExtentCompactionReport`` — what one ``compact()`` pass of the region did.

Made and read by the parts of ``tiers.memory.extent``; the CUDA byte mover keeps staging
buffers in a ``LeaseState``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base import Lease


@dataclass(slots=True)
class ObjectExtent:
    offset: int  # start of the object's extent in the region
    nbytes: int  # the object's size (the extent may be rounded up)
    generation: int  # changes whenever the object moves
    touched: int  # LRU stamp, so eviction notices a load that raced its copy


@dataclass(frozen=True, slots=True)
class ExtentCompactionReport:
    moved: int
    bytes_moved: int
    blocked: int  # moves prevented by a lease
    largest_free_before: int
    largest_free_after: int

    @property
    def objects_moved(self) -> int:
        return self.moved


@dataclass(slots=True)
class PendingStore:
    offset: int
    is_writing: bool = False
    is_torn: bool = False  # a write failed or was cancelled: only success=False may follow


@dataclass(slots=True)
class LeaseState:
    lease: Lease
    views: list[memoryview] = field(default_factory=list)  # released at complete_load
    keepalive: list[object] = field(default_factory=list)  # staging buffers behind views
