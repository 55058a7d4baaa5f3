"""The peer tier: objects pulled straight from the daemon that holds them, Redis as the directory.

``PeerTier`` (``tier``) and its ``PeerTierOptions`` (``options``) are what the composition
root uses; ``directory`` (the descriptors in Redis), ``transport`` (the ``PeerTransport``
seam and its TCP implementation), ``serve`` (the owner's listener) and ``wire`` (frames and
the keyring handshake) are its parts.
"""

from .options import PeerTierOptions
from .tier import PeerTier

__all__ = ["PeerTier", "PeerTierOptions"]
