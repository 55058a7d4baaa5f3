"""What a load expects, and the identity checks of DESIGN §4 steps 4–8.

- ``Expectation`` — built with ``for_ref`` (a handoff: this exact state id and version)
  or ``for_key`` (prefix reuse: any object at this key); carries the requester's
  namespace and what the version registry knows (``newest_version``, ``state_id_stream``).
- ``check_identity(header, expect)`` — namespace, placement, position (and, for SSM
  snapshots, sealed and not speculative), fingerprint, then version and state id; raises
  the first failing check's ``RejectedState`` subclass.
- ``registry_refusal(state_id, expect)`` → the ``MisroutedState`` or ``StaleState`` that what
  the registry knows refuses on its own, or None: what a load by ref is told when no tier
  holds a copy to judge.

``sealed.open_sealed`` runs ``check_identity`` after the signature and format checks;
``classify`` and the daemon's engine build the expectations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .dtypes import TensorSpec
from .errors import (FingerprintMismatch, MisroutedState, NamespaceMismatch, PlacementMismatch, PositionMismatch,
                     StaleState)
from .identity import Kind, Namespace, StateKey, StateRef, fingerprint, stream_id
from .sealed_format import SealedHeader


@dataclass(frozen=True, slots=True)
class Expectation:
    """What a load states it expects. Build it with ``for_ref`` or ``for_key``.

    ``key`` carries the *requester's* namespace. ``newest_version`` and ``state_id_stream``
    come from the version registry: the newest version known for the stream, and the stream
    that the expected ``state_id`` was issued for. ``stream``: the expected stream
    (``stream_id(key, request_id)``) when the caller computed it already.
    """

    key: StateKey
    request_id: str | None = None
    step: int | None = None
    state_id: bytes | None = None
    version: int | None = None
    fingerprint: bytes | None = None
    newest_version: int | None = None
    state_id_stream: bytes | None = None
    tensors: tuple[TensorSpec, ...] | None = None
    allow_speculative: bool = False
    stream: bytes | None = None

    @classmethod
    def for_ref(cls, ref: StateRef, namespace: Namespace, **extra: Any) -> "Expectation":
        old = ref.key  # checked when the ref was made: only the namespace is the requester's
        key = old if old.namespace == namespace else StateKey.from_checked(
            namespace, old.kind, old.layer, old.prefix_hash, old.token_start, old.token_end, old.shard,
            old.group_layers)
        return cls(key, ref.request_id, ref.step, ref.state_id, ref.version, ref.fingerprint, **extra)

    @classmethod
    def for_key(cls, key: StateKey, **extra: Any) -> "Expectation":
        return cls(key, **extra)

    @property
    def is_handoff(self) -> bool:
        return self.state_id is not None


def check_identity(header: SealedHeader, expect: Expectation) -> None:
    got, want = header.key, expect.key
    if got.namespace != want.namespace:
        raise NamespaceMismatch(f"namespace {got.namespace.hex()[:16]}… is not the requester's "
                                f"{want.namespace.hex()[:16]}…")
    if got.placement() != want.placement():
        raise PlacementMismatch(f"object is {got.kind.name} layer {got.layer} shard {got.shard}; "
                                f"expected {want.kind.name} layer {want.layer} shard {want.shard}")
    if got.position() != want.position():
        raise PositionMismatch(f"object covers tokens [{got.token_start}, {got.token_end}) of prefix "
                               f"{got.prefix_hash.hex()[:12]}…; expected [{want.token_start}, "
                               f"{want.token_end}) of {want.prefix_hash.hex()[:12]}…")
    if got.kind is Kind.SSM:
        if header.contains_speculative and not expect.allow_speculative:
            raise PositionMismatch("snapshot contains speculative tokens")
        if not header.is_sealed:
            raise PositionMismatch("snapshot was not sealed at a committed token boundary")
    _check_fingerprint(header, expect)
    _check_version(header, expect)


def registry_refusal(state_id: bytes, expect: Expectation) -> MisroutedState | StaleState | None:
    """Why the version registry refuses a load of ``state_id`` with no copy to judge: the
    state_id was issued for another stream, or its version was superseded; None when it
    does not."""
    if expect.state_id_stream is not None and expect.request_id is not None \
            and expect.state_id_stream != (expect.stream or stream_id(expect.key, expect.request_id)):
        return MisroutedState(f"state_id {state_id.hex()} was issued for another stream")
    if expect.newest_version is not None and expect.version is not None and expect.newest_version > expect.version:
        return StaleState(f"version {expect.version} was superseded by {expect.newest_version}")
    return None


def _check_fingerprint(header: SealedHeader, expect: Expectation) -> None:
    if expect.request_id is not None:
        wanted = fingerprint(expect.key, expect.request_id, expect.step or 0)
        if expect.fingerprint is not None and expect.fingerprint != wanted:
            raise FingerprintMismatch("the reference's fingerprint does not match its own identity")
    else:
        prov = header.provenance
        wanted = fingerprint(expect.key, prov.request_id, prov.step)
    if header.fingerprint != wanted:
        raise FingerprintMismatch("object fingerprint differs from the one recomputed from the expectation")


def _check_version(header: SealedHeader, expect: Expectation) -> None:
    if expect.state_id is not None:
        if expect.state_id_stream is not None and expect.state_id_stream != (
                expect.stream or stream_id(expect.key, expect.request_id or "")):
            raise MisroutedState(f"state_id {expect.state_id.hex()} was issued for another stream")
        if header.state_id != expect.state_id:
            if expect.version is not None and header.version < expect.version:
                raise StaleState(f"found version {header.version}, older than the expected {expect.version}")
            if expect.version is not None and header.version > expect.version:
                raise StaleState(f"the expected version {expect.version} was superseded by {header.version}")
            raise MisroutedState(f"found state_id {header.state_id.hex()}, expected {expect.state_id.hex()}")
        if expect.version is not None and header.version != expect.version:
            raise MisroutedState(f"state_id {header.state_id.hex()} carries version {header.version}, "
                                 f"expected {expect.version}")
    if expect.newest_version is not None and header.version < expect.newest_version:
        raise StaleState(f"version {header.version} is older than the newest known {expect.newest_version}")
