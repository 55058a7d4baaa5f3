"""Client-side values: what batch calls take and what lookups return. No torch import.

- ``PutItem``        — one object of ``AsyncClient.put_many``: key, tensors, provenance, options.
- ``StoredRef``      — what a put returns: a ``StateRef`` (equal to, and hashed like, the
                       plain ref) that also says the ``tier`` it landed in, whether it was
                       ``published`` and whether it was ``durable`` (on a durable tier)
                       when the put was acknowledged.
- ``LookupResult``   — ``tokens`` restorable and the ``(StateRef, lease_id)`` objects backing
                       them; ``lease_ids`` lists the leases to ``release`` when done.
- ``named_tensors(tensors)`` — a dict or a sequence of ``(name, tensor)`` pairs as an ordered
                       list of pairs (the payload order), refusing duplicate names.
- ``boundaries_to_wire`` / ``boundaries_from_tokens`` — LOOKUP's ``(token_end, prefix)`` list;
  ``lookup_meta(...)`` — a LOOKUP request's meta (the SDK's ``lookup`` and ``statetier lookup``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import PREFIX_HASH_BYTES, StateKey, StateRef, prefix_hashes


@dataclass(frozen=True, slots=True)
class PutItem:
    """One put of a batch. ``tensors``: ``{name: tensor}`` or ``[(name, tensor), ...]``."""

    key: StateKey
    tensors: Any
    request_id: str
    step: int = 0
    publish: bool = False
    version: int | None = None
    speculative: bool = False
    durable: bool = False


@dataclass(frozen=True, slots=True, eq=False)
class StoredRef(StateRef):
    """A ``StateRef`` as a put returned it; compares and hashes as the plain ref."""

    tier: str = ""
    published: bool = False
    durable: bool = False

    def as_ref(self) -> StateRef:
        return StateRef(self.key, self.request_id, self.step, self.state_id, self.version, self.fingerprint)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StateRef):
            return NotImplemented
        mine = self.as_ref()
        return mine == (other.as_ref() if isinstance(other, StoredRef) else other)

    def __hash__(self) -> int:
        return hash(self.as_ref())


@dataclass(slots=True)
class LookupResult:
    """The joint hit: ``tokens`` restorable, and the objects (leased unless asked not to)."""

    tokens: int
    objects: list[tuple[StateRef, int | None]] = field(default_factory=list)

    @property
    def refs(self) -> list[StateRef]:
        return [ref for ref, _ in self.objects]

    @property
    def lease_ids(self) -> list[int]:
        return [lease for _, lease in self.objects if lease is not None]


def named_tensors(tensors: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    pairs = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    names = set()
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise InvalidRequest("tensors must be a dict {name: tensor} or a sequence of (name, tensor)")
        if pair[0] in names:
            raise InvalidRequest(f"tensor name {pair[0]!r} appears twice")
        names.add(pair[0])
    if not pairs:
        raise InvalidRequest("a put needs at least one tensor")
    return pairs


def boundaries_to_wire(boundaries: Sequence[tuple[int, bytes]]) -> list[list]:
    out, last = [], -1
    for item in boundaries:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise InvalidRequest("each boundary must be (token_end, prefix_hash)")
        end, prefix = item
        if not isinstance(end, int) or isinstance(end, bool) or end <= last:
            raise InvalidRequest("boundary token ends must be ascending integers")
        if not isinstance(prefix, (bytes, bytearray)) or len(prefix) != PREFIX_HASH_BYTES:
            raise InvalidRequest(f"a boundary prefix hash must be {PREFIX_HASH_BYTES} bytes")
        out.append([end, bytes(prefix).hex()])
        last = end
    return out


def boundaries_from_tokens(token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[tuple[int, bytes]]:
    """Every full-block boundary of ``token_ids`` with its chained prefix hash."""
    hashes = prefix_hashes(token_ids, block_size, seed=seed)
    return [((i + 1) * block_size, h) for i, h in enumerate(hashes)]


def lookup_meta(namespace_hex: str, attention_layers: Sequence[int], ssm_layers: Sequence[int],
                boundaries: Sequence[tuple[int, bytes]], *, kv_layout: str, lease: bool, tp_size: int) -> dict:
    return {"ns": namespace_hex, "attention_layers": [int(x) for x in attention_layers],
            "ssm_layers": [int(x) for x in ssm_layers], "boundaries": boundaries_to_wire(boundaries),
            "kv_layout": kv_layout, "lease": bool(lease), "tp_size": int(tp_size)}
