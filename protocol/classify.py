"""Judging a loaded object: what a tier found under an id, classified in DESIGN §4 order.

A tier reports what it found (the bytes stored under an id, checked for *integrity* only:
framing against the header's own lengths, signature, format, payload digest); the caller
that knows what it expected decides the reason with ``classify``. Every tier goes through
this one path, so the first failing check names the fault on every tier alike.

- ``DAMAGE``            — the rejections that mean the stored bytes themselves are damaged
                          (checks 1–3 and 9). Only these remove a copy and count as damage.
                          ``UnknownKey`` (a ``BadSignature`` whose key id this keyring does
                          not hold or no longer verifies) is not damage: another keyring, or
                          a rotation rolled out too fast, says nothing about the bytes, and
                          the copy may be the one every other node can read. It is refused
                          and left in place, like an identity refusal.
- ``is_damage(exc)``    — ``exc`` is one of ``DAMAGE`` and not ``UnknownKey``.
- ``open_intact(blob, keyring, verified=None)`` → ``Opened``: what a tier (or ``statetier verify``) may check
                          without an expectation: checks 1–3 and 9, i.e. damage only.
- ``classify(blob, expect, keyring, *, stored_as, verify_payload=True)`` → ``Opened``, or
                          the first failing check's ``RejectedState``. ``stored_as`` is the id
                          the object was found under: an intact, authenticated object that
                          belongs to another identity gets the identity reason of checks 4–8
                          (``NamespaceMismatch`` … ``StaleState``/``MisroutedState``), never
                          ``CorruptPayload``; one whose identity matches but whose state_id is
                          not ``stored_as`` is ``MisroutedState``.
  Bytes beyond what the header declares of itself (an object written over a longer one's
                          region leaves that one's tail behind) are not judged: the object
                          is what its own header frames, and fewer bytes are ``truncated``.
- ``skip_reason(exc)``  — the bounded label a candidate skipped for ``exc`` is counted under:
                          ``speculative``, ``stale``, ``damaged``, ``unknown_key`` or ``misfiled``.
"""

from __future__ import annotations

import dataclasses
import struct

from .errors import (
    BadSignature,
    CorruptPayload,
    MalformedState,
    PositionMismatch,
    RejectedState,
    StaleState,
    TruncatedState,
    UnknownKey,
    UnsupportedFormat,
)
from .digests import Bytes
from .keyring import Keyring
from .expectation import Expectation
from .sealed import Opened, VerifiedHeaders, open_sealed
from .sealed_format import MAGIC, decode_header

DAMAGE = (TruncatedState, MalformedState, BadSignature, UnsupportedFormat, CorruptPayload)
SKIP_REASONS = ("speculative", "stale", "damaged", "unknown_key", "misfiled")
# The lengths every sealed object declares in its prefix (docs/protocol.md §1): header_len
# (u32 at byte 8) and payload_len (u64 at byte 16), after the 4-byte magic.
_DECLARED = struct.Struct("<8xI4xQ")


def is_damage(exc: BaseException) -> bool:
    return isinstance(exc, DAMAGE) and not isinstance(exc, UnknownKey)


def classify(blob: Bytes, expect: Expectation, keyring: Keyring, *, stored_as: bytes,
             verify_payload: bool = True, verified: VerifiedHeaders | None = None) -> Opened:
    """Verify ``blob`` (found under ``stored_as``) against ``expect``; see the module docstring.
    ``verified``: headers already verified, by their exact bytes (``sealed.VerifiedHeaders``)."""
    if expect.state_id is None:  # by key: the object must at least be the one the index named
        expect = dataclasses.replace(expect, state_id=bytes(stored_as))
    blob = _as_declared(memoryview(blob).cast("B"))
    try:
        return open_sealed(blob, expect, keyring, verify_payload=verify_payload, verified=verified)
    except PositionMismatch as exc:
        exc.detail["speculative"] = _is_speculative(blob)
        raise


def open_intact(blob: Bytes, keyring: Keyring, *, verify_payload: bool = True,
                verified: VerifiedHeaders | None = None) -> Opened:
    """The object ``blob`` frames, checked for damage only (no identity: that needs an
    expectation, and is the reader's judgement). ``verified``: as for ``classify``."""
    return open_sealed(_as_declared(memoryview(blob).cast("B")), None, keyring, verify_payload=verify_payload,
                       verified=verified)


def skip_reason(exc: RejectedState) -> str:
    if isinstance(exc, UnknownKey):
        return "unknown_key"
    if is_damage(exc):
        return "damaged"
    if isinstance(exc, PositionMismatch) and exc.detail.get("speculative"):
        return "speculative"
    if isinstance(exc, StaleState):
        return "stale"
    return "misfiled"


def _as_declared(view: memoryview) -> memoryview:
    """``view`` cut to the size its header declares, when more bytes are present."""
    if view.nbytes < _DECLARED.size or bytes(view[:4]) != MAGIC:
        return view
    header_len, payload_len = _DECLARED.unpack_from(view, 0)
    declared = header_len + payload_len
    return view[:declared] if 0 < declared < view.nbytes else view


def _is_speculative(blob: Bytes) -> bool:
    try:
        return decode_header(blob).contains_speculative
    except RejectedState:
        return False


__all__ = ["DAMAGE", "SKIP_REASONS", "classify", "is_damage", "open_intact", "skip_reason"]
