"""The memory tiers: pinned host memory and device memory, one preallocated region each.

``HostTier`` (``host.py``: a shared-memory arena only the daemon maps) and ``DeviceTier``
(``device.py``: one preallocated torch tensor, side-stream copies) are all the daemon
touches. Both are an ``ExtentTier`` over an ``ExtentAllocator`` (``tiers/allocator.py``,
which the daemon's per-connection windows use too). Inside:

- ``extent`` — ``ExtentTier``: lifecycle, stores, index, eviction; the medium moves bytes.
- ``load`` / ``compaction`` — its parts: leases and reads; ``compact()``.
- ``placement`` — what it records per object, store and lease.
- ``hostbytes`` — the byte movers over host memory (the arena; a device pool off CUDA).
- ``pins`` — executor copies that pin their extents; frees that wait for them.
- ``rawmemory`` — buffer addresses, views and GIL-free copies.
"""

from .device import DeviceTier
from .host import HostTier

__all__ = ["DeviceTier", "HostTier"]
