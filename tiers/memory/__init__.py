"""The memory tiers: pinned host memory and device memory, one preallocated region each.

``HostTier`` (``host.py``: a shared-memory arena only the daemon maps) and ``DeviceTier``
(``device.py``: one preallocated torch tensor, side-stream copies) are all the daemon
touches. Both are an ``ExtentTier`` (``extent.py``: leases, eviction, defragmentation over
an ``ExtentAllocator``, ``tiers/allocator.py``, which the daemon's per-connection windows use too) on raw memory (``rawmemory.py``).
"""

from .device import DeviceTier
from .host import HostTier

__all__ = ["DeviceTier", "HostTier"]
