"""Group objects (DESIGN §3): one object per block for every layer of a layer group.

A KV group object holds one block (token span) of every attention layer of a group; an
SSM group object holds every Mamba layer of a group at one boundary. Its ``StateKey`` has
``layer`` = the group id and ``group_layers`` = the group's layers (in the producer's
order); its payload holds one region per tensor of each layer, named ``"<layer>.<name>"``,
layer by layer in the group's order (docs/protocol.md §2.3).

- ``LayerGroup(kind, group_id, layers)`` — a group of layers stored together;
  ``key(namespace, prefix_hash, token_start, token_end, shard)`` → its ``StateKey``;
  ``of_key(key)`` → the group a key names (``None`` for a per-layer key).
- ``region_name(layer, name)`` / ``split_region_name(text)`` — a layer's tensor name in a
  group object's payload, and back.
- ``check_regions(key, names)`` — a put's tensor names cover exactly ``key``'s group layers
  (every layer, no other): ``PlacementMismatch`` (DESIGN §4 step 5) otherwise.
- ``check_layers(key, layers)`` — layers chosen for a partial load belong to the group.
- ``chosen(tensors, layers)`` — the descriptors (or specs) of the chosen layers, in payload order.

Sans-I/O: used by the daemon (puts, partial loads, lookups by group) and the SDK alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, TypeVar, cast

from .dtypes import TensorSpec
from .errors import InvalidRequest, PlacementMismatch, quote_untrusted
from .identity import MAX_U32, Kind, Namespace, StateKey

T = TypeVar("T")

_SEPARATOR = "."


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers whose state is stored together: ``kind`` KV (one block of each) or SSM (each
    layer's snapshot at one boundary); ``group_id`` is the key's ``layer``."""

    kind: Kind
    group_id: int
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind.parse(self.kind))
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise InvalidRequest("a layer group needs at least one layer")
        if len(set(self.layers)) != len(self.layers):
            raise InvalidRequest(f"layer group {self.group_id} names a layer twice")
        for value in (self.group_id, *self.layers):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_U32:
                raise InvalidRequest(f"layer group ids and layers must be integers in [0, {MAX_U32}]")

    def key(self, namespace: Namespace, prefix_hash: bytes, token_start: int, token_end: int,
            shard: int = 0) -> StateKey:
        return StateKey(namespace, self.kind, self.group_id, prefix_hash, token_start, token_end, shard,
                        self.layers)

    @classmethod
    def of_key(cls, key: StateKey) -> "LayerGroup | None":
        return cls(key.kind, key.layer, key.group_layers) if key.group_layers else None



def region_name(layer: int, name: str) -> str:
    """``name`` of ``layer`` as a group object's payload names it."""
    return f"{layer}{_SEPARATOR}{name}"


def split_region_name(text: str) -> tuple[int, str]:
    """``(layer, name)`` of a group object's tensor name; ``PlacementMismatch`` when it names none."""
    layer, sep, name = text.partition(_SEPARATOR)
    if not sep or not name or not layer.isdigit() or not layer.isascii():
        raise PlacementMismatch(f"tensor {quote_untrusted(text)} of a group object names no layer "
                                f"('<layer>{_SEPARATOR}<name>')")
    return int(layer), name


def check_regions(key: StateKey, names: Iterable[str]) -> None:
    """A group object's tensor names cover every layer of ``key``'s group and no other."""
    group = set(key.group_layers)
    found = {split_region_name(name)[0] for name in names}
    if found - group:
        raise PlacementMismatch(f"layers {sorted(found - group)} are not in group {key.layer} "
                                f"(layers {list(key.group_layers)})")
    if group - found:
        raise PlacementMismatch(f"group {key.layer} object misses layers {sorted(group - found)}")


def check_layers(key: StateKey, layers: Sequence[int]) -> None:
    """Layers chosen for a partial load: of ``key``'s group, each once, at least one."""
    if not key.group_layers:
        raise InvalidRequest("only a group object's key can choose layers")
    if not layers or len(set(layers)) != len(layers):
        raise InvalidRequest("a partial load names each chosen layer once")
    other = sorted(set(layers) - set(key.group_layers))
    if other:
        raise PlacementMismatch(f"layers {other} are not in group {key.layer} (layers {list(key.group_layers)})")


def chosen(tensors: Sequence[T], layers: Sequence[int] | None) -> list[T]:
    """The items of ``tensors`` (descriptors, with ``.spec``, or specs) of the chosen layers,
    in payload order; all of them when ``layers`` is None."""
    if layers is None:
        return list(tensors)
    wanted = set(layers)
    return [t for t in tensors if split_region_name(cast(TensorSpec, getattr(t, "spec", t)).name)[0] in wanted]
