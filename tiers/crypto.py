"""Encryption at rest for the disk and Redis tiers: AES-256-GCM over the payload.

``AtRestCipher`` wraps a sealed object into an envelope and back::

    0   4  magic b"STEN"
    4   1  envelope version (1)
    5   3  reserved, zero
    8   8  at-rest key id
    16 12  nonce (random)
    28  4  header_len u32
    32  …  the sealed header, in clear (it is the GCM associated data)
    …   …  AES-GCM ciphertext of the payload, then the 16-byte tag

The header stays readable (indexes and ``inspect`` need it) and authenticated; the payload
is confidential. Keys are chosen per tenant: ``keys_by_namespace`` maps a namespace digest
to a key id, anything else uses ``default_key_id``. ``open_envelope`` raises
``CorruptPayload`` for a tag that does not verify or a key this node does not hold.
"""

from __future__ import annotations

import os
import struct

from statetier.protocol.errors import ConfigError, CorruptPayload, TruncatedState
from statetier.protocol.sealed import PREFIX_BYTES, decode_header

from .base import Buffer

ENVELOPE_MAGIC = b"STEN"
_ENV = struct.Struct("<4sB3x8s12sI")
ENVELOPE_BYTES = _ENV.size
TAG_BYTES = 16


class AtRestCipher:
    def __init__(self, keys: dict[bytes, bytes], default_key_id: bytes,
                 keys_by_namespace: dict[bytes, bytes] | None = None) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if default_key_id not in keys:
            raise ConfigError("at-rest default key id is not among the keys")
        for key_id, key in keys.items():
            if len(key_id) != 8 or len(key) != 32:
                raise ConfigError("at-rest keys need an 8-byte id and 32 key bytes (AES-256)")
        self._aead = {key_id: AESGCM(key) for key_id, key in keys.items()}
        self.default_key_id = default_key_id
        self.keys_by_namespace = dict(keys_by_namespace or {})

    @classmethod
    def generate(cls) -> "AtRestCipher":
        key_id = os.urandom(8)
        return cls({key_id: os.urandom(32)}, key_id)

    def seal_envelope(self, blob: Buffer) -> bytes:
        view = memoryview(blob).cast("B")
        header = decode_header(view)
        key_id = self.keys_by_namespace.get(header.key.namespace.digest, self.default_key_id)
        nonce = os.urandom(12)
        head = bytes(view[: header.header_len])
        ciphertext = self._aead[key_id].encrypt(nonce, view[header.header_len :], head)
        return _ENV.pack(ENVELOPE_MAGIC, 1, key_id, nonce, header.header_len) + head + ciphertext

    def open_envelope(self, stored: Buffer) -> bytes:
        view = memoryview(stored).cast("B")
        if view.nbytes < ENVELOPE_BYTES + PREFIX_BYTES + TAG_BYTES:
            raise TruncatedState("encrypted object shorter than its envelope")
        magic, version, key_id, nonce, header_len = _ENV.unpack_from(view, 0)
        if magic != ENVELOPE_MAGIC or version != 1:
            raise CorruptPayload("not an at-rest envelope")
        aead = self._aead.get(key_id)
        if aead is None:
            raise CorruptPayload(f"at-rest key {key_id.hex()} is not held by this node")
        end = ENVELOPE_BYTES + header_len
        if end + TAG_BYTES > view.nbytes:
            raise TruncatedState("encrypted object shorter than its header")
        head = view[ENVELOPE_BYTES:end]
        from cryptography.exceptions import InvalidTag

        try:
            payload = aead.decrypt(nonce, view[end:], head)
        except InvalidTag:
            raise CorruptPayload("at-rest authentication tag does not verify") from None
        return bytes(head) + payload


def is_envelope(stored: Buffer) -> bool:
    return bytes(memoryview(stored)[:4]) == ENVELOPE_MAGIC
