"""The one error tree of statetier, shared by the daemon, the tiers and the clients.

Every class has a stable wire ``code`` (u16, sent in error frames) and a ``reason``
(a short snake_case string used as the Prometheus ``reason`` label)::

    StatetierError                      code   reason
    ├── RejectedState                   (a stored object refused on load or put; DESIGN §4)
    │   ├── TruncatedState              100    truncated         1. framing: lengths
    │   ├── MalformedState              101    malformed         1. framing: magic, layout
    │   ├── BadSignature                102    bad_signature     2. signature
    │   │   └── UnknownKey              111    unknown_key       2. key id not in this keyring
    │   ├── UnsupportedFormat           103    unsupported_format 3. format version
    │   ├── NamespaceMismatch           104    namespace         4. namespace
    │   ├── PlacementMismatch           105    placement         5. kind, layer, shard
    │   ├── PositionMismatch            106    position          6. prefix hash, token span
    │   ├── FingerprintMismatch         107    fingerprint       7. fingerprint
    │   ├── StaleState                  108    stale             8. state_id / version
    │   ├── MisroutedState              109    misrouted         8. state_id of another stream
    │   └── CorruptPayload              110    corrupt_payload   9. payload digest, tiling
    ├── NotFound                        200    not_found
    ├── LeaseError                      210    lease             (unknown or expired lease)
    ├── CapacityError                   300    capacity          (no room in a tier, disk full)
    ├── QuotaExceeded                   301    quota
    ├── Busy                            302    busy              (byte budget exhausted)
    ├── Unavailable                     310    unavailable       (a backend is unreachable)
    │   ├── RegistryUnavailable         311    registry_unavailable (the shared version registry
    │   │                                                      is unreachable and this op needs it)
    │   └── PeerLost                    312    peer_lost         (the daemon holding an object
    │                                                          died, hung or broke off mid-pull)
    ├── ProtocolError                   400    protocol          (wire frames)
    │   ├── FrameTooLarge               401    frame_too_large
    │   ├── MalformedFrame              402    malformed_frame
    │   ├── UnsupportedProtocol         403    unsupported_protocol
    │   └── IllegalTransition           404    illegal_transition (a connection event its phase forbids)
    ├── InvalidRequest                  410    invalid_request
    │   └── DestinationMismatch         411    destination_mismatch (a load's ``into`` differs)
    ├── Unauthorized                    420    unauthorized
    ├── Forbidden                       421    forbidden
    ├── ConfigError                     430    config
    └── InternalError                   500    internal

``ClientClosedError`` is programmer misuse (a ``RuntimeError``), never sent on the wire.
``error_from_code(code, message)`` rebuilds the class on the client side; unknown codes
become ``InternalError``. ``ERRORS_BY_CODE`` is the complete table (tests check it).

Text a peer sent (a tenant name, a dtype, a tensor name) enters a message only through
``quote_untrusted(value)`` (escaped, quoted, at most ``UNTRUSTED_CHARS`` characters kept),
and a message that may hold such text enters a log line through ``bounded_text(message)``:
an unauthenticated peer can neither flood the log nor write control characters into it.
"""

from __future__ import annotations

from typing import Any, ClassVar


class StatetierError(Exception):
    """Base of every statetier error. ``code`` is the wire code, ``reason`` the metric label."""

    code: ClassVar[int] = 1
    reason: ClassVar[str] = "error"

    def __init__(self, message: str = "", **detail: object) -> None:
        super().__init__(message or self.reason)
        self.message = message or self.reason
        self.detail = detail

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # keeps errors picklable for executors; never sent as pickle
        return (_rebuild, (type(self), self.message, self.detail))


def _rebuild(cls: type[StatetierError], message: str, detail: dict[str, object]) -> StatetierError:
    return cls(message, **detail)


class RejectedState(StatetierError):
    """A stored object that must not be handed over: its identity or bytes disagree."""

    code = 99
    reason = "rejected"


class TruncatedState(RejectedState):
    code = 100
    reason = "truncated"


class MalformedState(RejectedState):
    code = 101
    reason = "malformed"


class BadSignature(RejectedState):
    code = 102
    reason = "bad_signature"


class UnknownKey(BadSignature):
    """Signed under a key id this keyring does not hold (or no longer verifies): a
    configuration or rotation problem, not damaged bytes. The object is left where it is."""

    code = 111
    reason = "unknown_key"


class UnsupportedFormat(RejectedState):
    code = 103
    reason = "unsupported_format"


class NamespaceMismatch(RejectedState):
    code = 104
    reason = "namespace"


class PlacementMismatch(RejectedState):
    code = 105
    reason = "placement"


class PositionMismatch(RejectedState):
    code = 106
    reason = "position"


class FingerprintMismatch(RejectedState):
    code = 107
    reason = "fingerprint"


class StaleState(RejectedState):
    code = 108
    reason = "stale"


class MisroutedState(RejectedState):
    code = 109
    reason = "misrouted"


class CorruptPayload(RejectedState):
    code = 110
    reason = "corrupt_payload"


class NotFound(StatetierError):
    code = 200
    reason = "not_found"


class LeaseError(StatetierError):
    code = 210
    reason = "lease"


class CapacityError(StatetierError):
    code = 300
    reason = "capacity"


class QuotaExceeded(StatetierError):
    code = 301
    reason = "quota"


class Busy(StatetierError):
    code = 302
    reason = "busy"


class Unavailable(StatetierError):
    code = 310
    reason = "unavailable"


class RegistryUnavailable(Unavailable):
    code = 311
    reason = "registry_unavailable"


class PeerLost(Unavailable):
    """The daemon that holds an object (the peer tier's owner) refused the connection, broke
    it off or did not answer within the pull's deadline: nothing it sent is served."""

    code = 312
    reason = "peer_lost"


class ProtocolError(StatetierError):
    code = 400
    reason = "protocol"


class FrameTooLarge(ProtocolError):
    code = 401
    reason = "frame_too_large"


class MalformedFrame(ProtocolError):
    code = 402
    reason = "malformed_frame"


class UnsupportedProtocol(ProtocolError):
    code = 403
    reason = "unsupported_protocol"


class IllegalTransition(ProtocolError):
    """An event a connection's phase does not allow (``protocol.phases``)."""

    code = 404
    reason = "illegal_transition"


class InvalidRequest(StatetierError):
    code = 410
    reason = "invalid_request"


class DestinationMismatch(InvalidRequest):
    """A load's destination (the caller's ``into`` tensors, the specs it sent) does not match
    the stored object's tensor names, dtypes or shapes: the request is wrong, not the bytes.
    Never counted as a rejection; the stored copy is left as it is and stays loadable."""

    code = 411
    reason = "destination_mismatch"


class Unauthorized(StatetierError):
    code = 420
    reason = "unauthorized"


class Forbidden(StatetierError):
    code = 421
    reason = "forbidden"


class ConfigError(StatetierError):
    code = 430
    reason = "config"


class InternalError(StatetierError):
    code = 500
    reason = "internal"


class ClientClosedError(RuntimeError):
    """The client was used after ``close()``: a programming error, not a data problem."""


def _all_subclasses(cls: type[StatetierError]) -> list[type[StatetierError]]:
    found: list[type[StatetierError]] = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


_ERROR_CLASSES: list[type[StatetierError]] = [StatetierError, *_all_subclasses(StatetierError)]
ERRORS_BY_CODE: dict[int, type[StatetierError]] = {cls.code: cls for cls in _ERROR_CLASSES}


def error_from_code(code: int, message: str = "") -> StatetierError:
    """Rebuild the error a peer sent; an unknown code becomes ``InternalError``."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        return InternalError(f"unknown error code {code}: {message}")
    return cls(message)


UNTRUSTED_CHARS = 64
LOGGED_CHARS = 512


def bounded_text(text: object, limit: int = LOGGED_CHARS) -> str:
    """``text`` with at most ``limit`` characters kept, every non-printable or non-ASCII
    character (newlines, escapes, lone surrogates) written as a backslash escape."""
    text = str(text)
    kept = repr(text[:limit])[1:-1].encode("ascii", "backslashreplace").decode("ascii")
    return kept if len(text) <= limit else f"{kept}...(+{len(text) - limit} chars)"


def quote_untrusted(value: object, limit: int = UNTRUSTED_CHARS) -> str:
    """A peer-supplied value for an error message: quoted, escaped and bounded."""
    return f"'{bounded_text(value, limit)}'"
