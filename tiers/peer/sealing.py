"""AES-GCM on the peer wire (``peers.encrypt``): an object's bytes hidden from the network.

Integrity was there already (the puller verifies every object's signed header and digests
where it lands); this adds confidentiality: KV pages can give a prompt away.

- ``Channel(session)`` — one direction of one authenticated connection, owner to puller:
  AES-256-GCM under ``HKDF-SHA256(session key, info="statetier/peer-seal/1 owner-to-puller")``
  (the session key is fresh per connection: both ends' handshake nonces make it; the label
  names the direction, so a stream the other way would get a key of its own). ``seal`` /
  ``open`` one chunk: its nonce the direction's counter (8 bytes little-endian, then 4 zero
  bytes), counted up by both ends per chunk, so no nonce repeats under one key; its
  associated data the object id and its length, so a chunk is bound to the object it is part
  of. ``open`` of a chunk whose tag does not verify (a flipped byte, a chunk out of place)
  raises ``Altered``: what was decrypted is never served.
- ``Altered`` — a ``ConnectionError``: the bytes were altered between the two processes (the
  owner's own bytes are checked where they land, as ever), so the transport treats it as a
  transfer broken off: the connection dropped, the pull tried again on a fresh one within its
  deadline (``retried``), ``PeerLost`` once every try failed.
- ``chunks(length)`` — the plaintext extents an object of ``length`` bytes is sealed in
  (``CHUNK`` bytes each, the last shorter); each crosses the wire as its ciphertext and its
  ``TAG`` bytes tag: ``sealed_length(length)`` bytes in all.

The cost: one pass over the bytes on each side, the owner's encryption (``encrypt_into``,
from the object where it lies into a chunk buffer) and the puller's decryption
(``decrypt_into``, from the chunk received into a scratch buffer straight into ``into``); no
other copy. NIXL reads (``tiers.peer.nixl``) are not covered: the fabric reads the owner's
memory as it lies.
"""

from __future__ import annotations

from typing import Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

CHUNK = 1 << 20  # plaintext bytes per chunk
TAG = 16
OWNER_TO_PULLER = b"statetier/peer-seal/1 owner-to-puller"


class Altered(ConnectionError):
    """An encrypted chunk of a pull did not verify: altered on the wire."""


def seal_key(session: bytes, direction: bytes = OWNER_TO_PULLER) -> bytes:
    """The AES-256 key of one direction of the connection whose session key is ``session``."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=direction).derive(session)


def chunks(length: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each chunk of an object of ``length`` bytes (none for an empty one)."""
    for start in range(0, length, CHUNK):
        yield start, min(start + CHUNK, length)


def sealed_length(length: int) -> int:
    """The bytes an object of ``length`` bytes takes on the wire, sealed."""
    return length + TAG * ((length + CHUNK - 1) // CHUNK)


def associated(object_id: bytes, length: int) -> bytes:
    return object_id + length.to_bytes(8, "little")


class Channel:
    def __init__(self, session: bytes, direction: bytes = OWNER_TO_PULLER) -> None:
        self._aead = AESGCM(seal_key(session, direction))
        self._counter = 0

    def _nonce(self) -> bytes:
        nonce = self._counter.to_bytes(8, "little") + bytes(4)
        self._counter += 1
        return nonce

    def seal(self, aad: bytes, plain: memoryview, out: memoryview) -> None:
        """``plain`` encrypted into ``out`` (``len(plain) + TAG`` bytes: the ciphertext, the tag)."""
        self._aead.encrypt_into(self._nonce(), plain, aad, out)

    def open(self, aad: bytes, sealed: memoryview, out: memoryview) -> None:
        """``sealed`` (a chunk's ciphertext and tag) decrypted into ``out`` (``len(sealed) - TAG``
        bytes), or ``Altered``."""
        try:
            self._aead.decrypt_into(self._nonce(), sealed, aad, out)
        except InvalidTag:
            raise Altered("an encrypted chunk did not verify (AES-GCM tag): altered on the wire") from None
