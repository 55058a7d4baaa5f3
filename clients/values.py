"""Client-side values: what batch calls take and what lookups return. No torch import.

- ``PutItem``        — one object of ``AsyncClient.put_many``: key, tensors (a group object's
                       regions ``{layer: {name: tensor}}`` when the key names a group),
                       provenance, options, and the engine's block ``tag`` its KV events carry.
- ``LayerGroup``     — layers stored together in group objects (``protocol.groups``).
- ``StoredRef``      — what a put returns: a ``StateRef`` (equal to, and hashed like, the
                       plain ref) that also says the ``tier`` it landed in, whether it was
                       ``published`` and whether it was ``durable`` (on a durable tier)
                       when the put was acknowledged.
- ``LookupResult``   — ``tokens`` restorable and the ``(StateRef, lease_id)`` objects backing
                       them; ``lease_ids`` lists the leases to ``release`` when done.
- ``named_tensors(tensors)`` — a dict or a sequence of ``(name, tensor)`` pairs as an ordered
                       list of pairs (the payload order), refusing duplicate names.
- ``payload_pairs(key, tensors)`` — the same for any key: a group key's regions flattened in
                       the group's layer order (``"<layer>.<name>"``), every layer and no other
                       (``PlacementMismatch``); ``regrouped(tensors)`` — the way back;
                       ``group_selection(key, layers, into)`` — a group load's chosen layers
                       and flattened ``into``.
- ``boundaries_checked`` / ``boundaries_from_tokens`` — LOOKUP's ``(token_end, prefix)`` pairs;
  ``lookup_meta(...)`` — a LOOKUP request's ``LookupMeta`` (the SDK's ``lookup`` and
  ``statetier lookup``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.groups import LayerGroup, check_layers, check_regions, region_name, split_region_name
from statetier.protocol.identity import PREFIX_HASH_BYTES, StateKey, StateRef, prefix_hashes
from statetier.protocol.kv_events import BlockTag
from statetier.protocol.wire_meta import LookupMeta

__all__ = ["BlockTag", "LayerGroup", "LookupResult", "PutItem", "StoredRef", "boundaries_checked",
           "boundaries_from_tokens", "group_selection", "lookup_meta", "named_tensors", "payload_pairs", "regrouped"]


@dataclass(frozen=True, slots=True)
class PutItem:
    """One put of a batch. ``tensors``: ``{name: tensor}`` or ``[(name, tensor), ...]``; for a
    group key (``LayerGroup.key``), the regions ``{layer: {name: tensor}}`` of every layer."""

    key: StateKey
    tensors: Any
    request_id: str
    step: int = 0
    publish: bool = False
    version: int | None = None
    speculative: bool = False
    durable: bool = False
    tag: BlockTag | None = None  # the engine's block, named in the object's KV events


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


def payload_pairs(key: StateKey, tensors) -> list[tuple[str, Any]]:
    """The ``(name, tensor)`` pairs of a put under ``key``, in payload order; a group key's
    regions flattened layer by layer in the group's order."""
    if not key.group_layers:
        return named_tensors(tensors)
    if not isinstance(tensors, Mapping) or not all(isinstance(r, Mapping) for r in tensors.values()):
        raise InvalidRequest("a group object's tensors are {layer: {name: tensor}}")
    check_regions(key, [region_name(layer, name) for layer, regions in tensors.items() for name in regions])
    return named_tensors([(region_name(layer, name), tensor)
                          for layer in key.group_layers for name, tensor in tensors[layer].items()])


def group_selection(key: StateKey, layers: Sequence[int] | None, into: Mapping | None
                    ) -> tuple[list[int] | None, dict[str, Any] | None]:
    """A group load's chosen layers to name on the wire (None: the whole object) and its
    ``into`` (``{layer: {name: tensor}}``) flattened to the payload's names, in group order.
    Without ``layers``, ``into``'s layers are the chosen ones."""
    if not key.group_layers:
        raise InvalidRequest("a group load needs the ref or key of a group object")
    if into is not None:
        if not isinstance(into, Mapping) or not all(isinstance(r, Mapping) for r in into.values()):
            raise InvalidRequest("a group load's into is {layer: {name: tensor}}")
        if layers is not None and sorted(layers) != sorted(into):
            raise InvalidRequest("a group load's into must hold exactly the chosen layers")
        layers = list(into)
    if layers is not None:
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
            raise InvalidRequest("layers must be integers")
        check_layers(key, list(layers))
    flat = None if into is None else {region_name(layer, name): tensor for layer in key.group_layers
                                      if layer in into for name, tensor in into[layer].items()}
    whole = layers is None or set(layers) == set(key.group_layers)
    return (None if whole or layers is None else [x for x in key.group_layers if x in set(layers)]), flat


def regrouped(tensors: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """A group object's loaded ``{"<layer>.<name>": tensor}`` as ``{layer: {name: tensor}}``."""
    out: dict[int, dict[str, Any]] = {}
    for full, tensor in tensors.items():
        layer, name = split_region_name(full)
        out.setdefault(layer, {})[name] = tensor
    return out


def boundaries_checked(boundaries: Sequence[tuple[int, bytes]]) -> tuple[tuple[int, bytes], ...]:
    """LOOKUP's boundaries: ascending token ends, each with its 32-byte prefix hash."""
    out, last = [], -1
    for item in boundaries:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise InvalidRequest("each boundary must be (token_end, prefix_hash)")
        end, prefix = item
        if not isinstance(end, int) or isinstance(end, bool) or end <= last:
            raise InvalidRequest("boundary token ends must be ascending integers")
        if not isinstance(prefix, (bytes, bytearray)) or len(prefix) != PREFIX_HASH_BYTES:
            raise InvalidRequest(f"a boundary prefix hash must be {PREFIX_HASH_BYTES} bytes")
        out.append((end, bytes(prefix)))
        last = end
    return tuple(out)


def boundaries_from_tokens(token_ids: Sequence[int], block_size: int, seed: int = 0) -> list[tuple[int, bytes]]:
    """Every full-block boundary of ``token_ids`` with its chained prefix hash."""
    hashes = prefix_hashes(token_ids, block_size, seed=seed)
    return [((i + 1) * block_size, h) for i, h in enumerate(hashes)]


def lookup_meta(namespace: bytes, attention_layers: Sequence[int], ssm_layers: Sequence[int],
                boundaries: Sequence[tuple[int, bytes]], *, kv_layout: str, lease: bool, tp_size: int,
                groups: Sequence[LayerGroup] = (), group_shards: Sequence[int] = ()) -> LookupMeta:
    if group_shards and len(group_shards) != len(groups):
        raise InvalidRequest(f"group_shards: one shard count per group ({len(groups)}), got {len(group_shards)}")
    return LookupMeta(namespace, boundaries_checked(boundaries), tuple(int(x) for x in attention_layers),
                      tuple(int(x) for x in ssm_layers),
                      tuple((g.kind.name.lower(), g.group_id, g.layers) for g in groups),
                      kv_layout, int(tp_size), bool(lease), group_shards=tuple(int(n) for n in group_shards))
