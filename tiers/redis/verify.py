"""Verifying what the Redis tier reads back, without redoing work for an object read before.

``VerifiedHeaders(keyring, size=4096).open(blob, object_id)`` → ``(SealedHeader, ObjectMeta)``
of a sealed object, or the ``RejectedState`` of ``open_intact``. Every call checks the
payload digest over the bytes it is given. The header is parsed and its signature checked
only when its exact bytes have not passed ``open_intact`` before (a bounded LRU of headers,
by object id) under the very key object the keyring hands out now: identical bytes under
an unchanged key verify identically, so a hit skips only work whose result is known. A key
retired, expired or replaced since is a miss, and ``open_intact`` decides again.
Integrity only (``protocol.classify``): whether the object is the one stored under
``object_id`` is the engine's judgement.

Used by ``RedisTier.read`` (the same page is read again and again by prefix reuse), on the
event loop and in executor threads alike (a lock guards the LRU); the payload check is
``protocol.sealed.verify_payload_only``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from statetier.protocol.keyring import Keyring, SigningKey
from statetier.protocol.classify import open_intact
from statetier.protocol.sealed import SealedHeader, verify_payload_only
from ..base import ObjectMeta


@dataclass(frozen=True, slots=True)
class _Verified:
    header_bytes: bytes
    header: SealedHeader
    meta: ObjectMeta
    key: SigningKey  # the key object the signature verified under


class VerifiedHeaders:
    def __init__(self, keyring: Keyring, size: int = 4096) -> None:
        self._keyring = keyring
        self._size = size
        self._entries: OrderedDict[bytes, _Verified] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, blob, object_id: bytes) -> tuple[SealedHeader, ObjectMeta]:
        view = memoryview(blob).cast("B")
        with self._lock:
            known = self._entries.get(object_id)
        if known is not None and self._still_holds(known, view):
            verify_payload_only(known.header, view[len(known.header_bytes):], self._keyring)
            return known.header, known.meta
        header = open_intact(view, self._keyring).header
        verified = _Verified(bytes(view[: header.header_len]), header, ObjectMeta.from_header(header),
                             self._keyring.get_for_verify(header.key_id))
        self._remember(object_id, verified)
        return header, verified.meta

    def _still_holds(self, known: _Verified, view: memoryview) -> bool:
        size = len(known.header_bytes)
        return (view.nbytes == size + known.header.payload_len
                and view[:size] == known.header_bytes
                and self._keyring.get_for_verify(known.header.key_id) is known.key)

    def _remember(self, object_id: bytes, verified: _Verified) -> None:
        with self._lock:
            self._entries[object_id] = verified
            self._entries.move_to_end(object_id)
            if len(self._entries) > self._size:
                self._entries.popitem(last=False)
