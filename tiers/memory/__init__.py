"""The memory tiers: pinned host memory and device memory, one preallocated region each.

``HostTier`` / ``HostTierOptions`` (``host.py``: a shared-memory arena only the daemon maps)
and ``DeviceTier`` / ``DeviceTierOptions`` (``device.py``: one preallocated torch tensor,
side-stream copies) are all the daemon touches. Both are an ``ExtentTier`` (``extent.py``)
over their medium (``HostArena``, ``DevicePool``) and an ``ExtentAllocator``
(``protocol.extents``). Inside:

- ``extent`` — ``ExtentTier`` and ``ExtentTierOptions``: one ``Ledger`` and one
  ``ExtentRegion``, handed to each part below.
- ``stores`` / ``loads`` / ``removal`` / ``compaction`` — its parts: reserved extents made
  visible; leases and reads; delete and LRU eviction; ``compact()``.
- ``region`` — the medium's interface, the extents while open (``ExtentSpace``).
- ``records`` — what is recorded per object, store and lease.
- ``hostbytes`` / ``torchbytes`` — the byte movers over host memory and over a torch pool.
- ``pins`` — executor copies that pin their extents; frees that wait for them.
- ``rawmemory`` — buffer addresses, views and GIL-free copies.
"""

from .device import DeviceTier, DeviceTierOptions
from .host import HostTier, HostTierOptions

__all__ = ["DeviceTier", "DeviceTierOptions", "HostTier", "HostTierOptions"]
