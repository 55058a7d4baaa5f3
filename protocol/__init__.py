"""statetier.protocol — sans-I/O core shared by the daemon, the tiers and the clients.

- ``identity``  — Namespace/NamespaceSpec, StateKey, Provenance, StateRef, prefix hashes
- ``dtypes``    — wire dtype codes and ``TensorSpec``
- ``keyring``   — HMAC / Ed25519 signing keys, rotation, key files
- ``sealed``    — the sealed object: ``seal``, ``open_sealed``, ``Opened``; the path users
                  import the format from (it re-exports the three below)
- ``sealed_format`` — byte layout and header codec: ``layout_payload``, ``SealedHeader``
- ``digests``   — ``DigestAlg``, region and payload digests
- ``expectation`` — ``Expectation``: what a load expects; the identity checks
- ``classify``  — judging a loaded object in DESIGN §4 order (identity vs damage)
- ``frames``    — the daemon's frame codec (length-prefixed, request ids, handshake)
- ``errors``    — the one error tree, with wire codes and metric reasons
- ``lru``, ``extents``, ``cancellation``, ``mappings`` — what the tiers, the daemon and the
                  clients all need: ``BoundedLru``, ``ExtentAllocator``,
                  ``wait_out_cancellation``, ``unmap`` (a shared-memory window let go)

Nothing here imports torch, redis, lmdb or prometheus_client, or does I/O.
"""

from .dtypes import TensorSpec
from .errors import StatetierError
from .identity import (Kind, Namespace, NamespaceSpec, Provenance, StateKey, StateRef, fingerprint, new_state_id,
                       prefix_hash, prefix_hashes, stream_id)
from .keyring import Keyring, SigAlg, SigningKey
from .digests import DigestAlg
from .expectation import Expectation
from .sealed import Opened, open_sealed, seal, seal_object
from .sealed_format import SealedHeader, decode_header, layout_payload

__all__ = [
    "DigestAlg", "Expectation", "Keyring", "Kind", "Namespace", "NamespaceSpec", "Opened",
    "Provenance", "SealedHeader", "SigAlg", "SigningKey", "StateKey", "StateRef",
    "StatetierError", "TensorSpec", "decode_header", "fingerprint", "layout_payload",
    "new_state_id", "open_sealed", "prefix_hash", "prefix_hashes", "seal", "seal_object",
    "stream_id",
]
