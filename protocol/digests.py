"""The digests a sealed object binds: one per tensor region, and one over them all.

- ``DigestAlg`` — ``BLAKE3`` (plain, unkeyed BLAKE3-256: anyone can recompute it) or
  ``XXH3_128`` (a corruption check only, for trusted media); ``label`` for logs.
- ``digest_region(alg, data)`` — the 32-byte digest of one region (a tensor plus its
  alignment padding). BLAKE3 of a region of ``thresholds.PARALLEL_HASH_BYTES`` or more runs
  on several threads (``max_threads=blake3.AUTO``): the daemon seals, and checks what no
  client will, at more than one core's speed.
- ``region_hasher(alg, nbytes)`` — the same digest computed incrementally (``update``,
  ``digest``), for a client that verifies bytes as they are copied into place; several
  threads for a region of ``nbytes`` past the same size (its updates should then be of
  ``hash_chunk(nbytes)`` bytes or more, so that the threads have work to share).
- ``payload_digest_of(alg, region_digests, payload_len)`` — the payload digest over the
  region digests (docs/protocol.md §2.2), so one pass over the bytes seals or verifies all.

Every byte hashed is counted in ``protocol.passes.PASSES`` (issue 25: passes per byte).

Used by ``sealed`` (sealing and checking payloads) and ``clients.transfers``. No key is
involved: the signed header is what makes the digests trustworthy.
"""

from __future__ import annotations

import enum
import struct
from typing import Protocol, Sequence

import blake3

from .passes import PASSES
from .thresholds import PARALLEL_HASH_BYTES

_AUTO = blake3.blake3.AUTO
#: Bytes copied, then hashed, at a time while they are still in cache (one thread), and when
#: the region is large enough for several threads to share each piece.
COPY_CHUNK = 256 << 10
PARALLEL_CHUNK = 4 << 20


class DigestAlg(enum.IntEnum):
    BLAKE3 = 1  # plain (unkeyed) BLAKE3-256: anyone can recompute it, nobody needs a key
    XXH3_128 = 2  # corruption check only, for trusted media

    @property
    def label(self) -> str:
        return "blake3" if self is DigestAlg.BLAKE3 else "xxh3-128"



Bytes = bytes | bytearray | memoryview


class RegionHasher(Protocol):
    """What ``region_hasher`` returns (a blake3 hasher or an xxh3 one)."""

    def update(self, data: Bytes, /) -> object: ...

    def digest(self) -> bytes: ...


def digest_region(alg: DigestAlg, data: Bytes) -> bytes:
    nbytes = memoryview(data).nbytes
    PASSES.count_hashed(nbytes)
    return _digest(alg, data, nbytes)


def _digest(alg: DigestAlg, data: Bytes, nbytes: int) -> bytes:
    if alg is DigestAlg.BLAKE3:
        return blake3.blake3(data, max_threads=_threads(nbytes)).digest()
    import xxhash

    return xxhash.xxh3_128_digest(data) + bytes(16)


def _threads(nbytes: int) -> int:
    return _AUTO if nbytes >= PARALLEL_HASH_BYTES else 1


def hash_chunk(nbytes: int) -> int:
    """How many bytes of a region of ``nbytes`` to copy, then hash, at a time."""
    return PARALLEL_CHUNK if nbytes >= PARALLEL_HASH_BYTES else COPY_CHUNK


def region_hasher(alg: DigestAlg, nbytes: int = 0) -> RegionHasher:
    """An incremental hasher of one region of ``nbytes`` (``update(bytes)``, ``digest()``)."""
    if alg is DigestAlg.BLAKE3:
        return _Region(blake3.blake3(max_threads=_threads(nbytes)), b"")
    import xxhash

    return _Region(xxhash.xxh3_128(), bytes(16))


class _Region:
    """A hasher whose updates are counted (``protocol.passes``); ``tail`` pads the digest."""

    __slots__ = ("_h", "_tail")

    def __init__(self, h: RegionHasher, tail: bytes) -> None:
        self._h = h
        self._tail = tail

    def update(self, data: Bytes) -> None:
        PASSES.count_hashed(memoryview(data).nbytes)
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest() + self._tail


def payload_digest_of(alg: DigestAlg, region_digests: Sequence[bytes], payload_len: int) -> bytes:
    """The payload digest over the region digests (docs/protocol.md §2.2)."""
    joined = struct.pack("<Q", payload_len) + b"".join(region_digests)
    return _digest(alg, memoryview(joined), len(joined))  # digests, not payload: no pass counted
