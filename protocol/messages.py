"""The daemon's request and reply bodies: identity values to and from JSON frame meta.

Frames (``frames.py``) carry a JSON object as ``meta`` and raw bytes as ``data``. This
module is the one place that turns identity values into that JSON and back, so the
daemon and the clients cannot disagree:

- ``key_to_wire`` / ``key_from_wire``                 — ``StateKey``
- ``provenance_to_wire`` / ``provenance_from_wire``   — ``Provenance``
- ``ref_to_wire`` / ``ref_from_wire``                 — ``StateRef``
- ``specs_to_wire`` / ``specs_from_wire``             — ``TensorSpec`` lists
- ``header_to_wire`` / ``header_from_wire``           — what a load tells the client
- ``field(meta, name, type)``                         — typed access, ``InvalidRequest`` otherwise
- ``build_value(what, factory, *args)``               — an identity value, ``InvalidRequest`` otherwise

Bytes travel as lowercase hex. Malformed input raises ``InvalidRequest`` naming the field.
The requests per opcode are documented in docs/frames.md ("Requests").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .dtypes import TensorSpec
from .errors import InvalidRequest, StatetierError
from .identity import Kind, Namespace, Provenance, StateKey, StateRef
from .sealed_format import SealedHeader

T = TypeVar("T")


def field(meta: dict[str, Any], name: str, kind: type | tuple[type, ...], *, default: Any = ...,
          optional: bool = False) -> Any:
    """``meta[name]`` checked against ``kind``; missing → default, or InvalidRequest."""
    if name not in meta or (optional and meta[name] is None):
        if default is not ...:
            return default
        if optional:
            return None
        raise InvalidRequest(f"missing field {name!r}")
    value = meta[name]
    if kind is int and isinstance(value, bool):
        raise InvalidRequest(f"field {name!r} must be an integer")
    if not isinstance(value, kind):
        raise InvalidRequest(f"field {name!r} must be {getattr(kind, '__name__', kind)}")
    return value


def _hex(meta: dict[str, Any], name: str, size: int | None = None) -> bytes:
    text = field(meta, name, str)
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise InvalidRequest(f"field {name!r} must be hex") from None
    if size is not None and len(raw) != size:
        raise InvalidRequest(f"field {name!r} must be {size} bytes")
    return raw


def build_value(what: str, factory: Callable[..., T], *args: Any) -> T:
    """``factory(*args)``, a ``TypeError``/``ValueError`` turned into ``InvalidRequest``."""
    try:
        return factory(*args)
    except StatetierError:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"bad {what}: {exc}") from exc


def key_to_wire(key: StateKey) -> dict[str, Any]:
    out: dict[str, Any] = {
        "ns": key.namespace.hex(),
        "kind": key.kind.name.lower(),
        "layer": key.layer,
        "shard": key.shard,
        "prefix": key.prefix_hash.hex(),
        "start": key.token_start,
        "end": key.token_end,
    }
    if key.group_layers:
        out["group"] = list(key.group_layers)
    return out


def key_from_wire(meta: dict[str, Any]) -> StateKey:
    if not isinstance(meta, dict):
        raise InvalidRequest("key must be an object")
    group = field(meta, "group", list, default=[])
    return build_value(
        "key", StateKey,
        Namespace(_hex(meta, "ns", 32)),
        Kind.parse(field(meta, "kind", str)),
        field(meta, "layer", int),
        _hex(meta, "prefix", 32),
        field(meta, "start", int),
        field(meta, "end", int),
        field(meta, "shard", int, default=0),
        tuple(group),
    )


def provenance_to_wire(prov: Provenance) -> dict[str, Any]:
    return {"request_id": prov.request_id, "step": prov.step, "producer": prov.producer_id,
            "created_at_ns": prov.created_at_ns}


def provenance_from_wire(meta: dict[str, Any]) -> Provenance:
    if not isinstance(meta, dict):
        raise InvalidRequest("provenance must be an object")
    return build_value(
        "provenance", Provenance,
        field(meta, "request_id", str),
        field(meta, "step", int, default=0),
        field(meta, "producer", str, default=""),
        field(meta, "created_at_ns", int, default=0),
    )


def ref_to_wire(ref: StateRef) -> dict[str, Any]:
    return {"key": key_to_wire(ref.key), "request_id": ref.request_id, "step": ref.step,
            "state_id": ref.state_id.hex(), "version": ref.version, "fingerprint": ref.fingerprint.hex()}


def ref_from_wire(meta: dict[str, Any]) -> StateRef:
    if not isinstance(meta, dict):
        raise InvalidRequest("ref must be an object")
    return build_value(
        "ref", StateRef,
        key_from_wire(field(meta, "key", dict)),
        field(meta, "request_id", str),
        field(meta, "step", int),
        _hex(meta, "state_id", 16),
        field(meta, "version", int),
        _hex(meta, "fingerprint", 32),
    )


def specs_to_wire(specs: Iterable[TensorSpec]) -> list[list[Any]]:
    return [[s.name, s.dtype, list(s.shape)] for s in specs]


def specs_from_wire(items: object) -> tuple[TensorSpec, ...]:
    if not isinstance(items, list):
        raise InvalidRequest("tensors must be a list")
    out: list[TensorSpec] = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and isinstance(item[1], str) and isinstance(item[2], list)
                and all(isinstance(d, int) and not isinstance(d, bool) for d in item[2])):
            raise InvalidRequest("each tensor must be [name, dtype, [dims…]]")
        out.append(build_value("tensor spec", TensorSpec, item[0], item[1], tuple(item[2])))
    return tuple(out)


def header_to_wire(header: SealedHeader) -> dict[str, Any]:
    """What a client needs to rebuild tensors from a loaded object's payload."""
    return {
        "ref": ref_to_wire(header.ref()),
        "producer": header.provenance.producer_id,
        "created_at_ns": header.provenance.created_at_ns,
        "tensors": [[t.spec.name, t.spec.dtype, list(t.spec.shape), t.offset] for t in header.tensors],
        "payload_len": header.payload_len,
    }


def header_from_wire(meta: dict[str, Any]) -> tuple[StateRef, list[tuple[TensorSpec, int]], int]:
    ref = ref_from_wire(field(meta, "ref", dict))
    tensors: list[tuple[TensorSpec, int]] = []
    for item in field(meta, "tensors", list):
        if not (isinstance(item, list) and len(item) == 4 and isinstance(item[3], int)):
            raise InvalidRequest("each loaded tensor must be [name, dtype, [dims…], offset]")
        (spec,) = specs_from_wire([item[:3]])
        tensors.append((spec, item[3]))
    return ref, tensors, field(meta, "payload_len", int)
