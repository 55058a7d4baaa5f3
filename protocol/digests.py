"""The digests a sealed object binds: one per tensor region, and one over them all.

- ``DigestAlg`` — ``BLAKE3`` (plain, unkeyed BLAKE3-256: anyone can recompute it) or
  ``XXH3_128`` (a corruption check only, for trusted media); ``label`` for logs.
- ``digest_region(alg, data)`` — the 32-byte digest of one region (a tensor plus its
  alignment padding).
- ``region_hasher(alg)`` — the same digest computed incrementally (``update``, ``digest``),
  for a client that verifies bytes as they are copied into place.
- ``payload_digest_of(alg, region_digests, payload_len)`` — the payload digest over the
  region digests (docs/protocol.md §2.2), so one pass over the bytes seals or verifies all.

Used by ``sealed`` (sealing and checking payloads) and ``clients.transfers``. No key is
involved: the signed header is what makes the digests trustworthy.
"""

from __future__ import annotations

import enum
import struct
from typing import Sequence

import blake3


class DigestAlg(enum.IntEnum):
    BLAKE3 = 1  # plain (unkeyed) BLAKE3-256: anyone can recompute it, nobody needs a key
    XXH3_128 = 2  # corruption check only, for trusted media

    @property
    def label(self) -> str:
        return "blake3" if self is DigestAlg.BLAKE3 else "xxh3-128"



def digest_region(alg: DigestAlg, data) -> bytes:
    if alg is DigestAlg.BLAKE3:
        return blake3.blake3(data).digest()
    import xxhash

    return xxhash.xxh3_128_digest(data) + bytes(16)


def region_hasher(alg: DigestAlg):
    """An incremental hasher of one region (``update(bytes)``, ``digest()``) for ``alg``."""
    if alg is DigestAlg.BLAKE3:
        return blake3.blake3()
    import xxhash

    return _Xxh3Region(xxhash.xxh3_128())


class _Xxh3Region:
    __slots__ = ("_h",)

    def __init__(self, h) -> None:
        self._h = h

    def update(self, data) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest() + bytes(16)


def payload_digest_of(alg: DigestAlg, region_digests: Sequence[bytes], payload_len: int) -> bytes:
    """The payload digest over the region digests (docs/protocol.md §2.2)."""
    joined = struct.pack("<Q", payload_len) + b"".join(region_digests)
    return digest_region(alg, memoryview(joined))
