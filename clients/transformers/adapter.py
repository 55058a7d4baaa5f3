"""Save, look up and restore a Hugging Face hybrid cache through a statetier client.

A request's cache is stored as (at most) two group objects (``protocol.groups``): one KV
object holding every attention layer's keys and values over ``[0, N)``, one SSM object
holding every SSM layer's conv and recurrent states after N tokens (``groups_of``).

- ``SavedState`` — the refs of the ``kv`` and ``ssm`` group objects, ``tokens`` absorbed,
  prefix hash, request id and step; ``to_json`` / ``from_json`` for the handoff.
- ``save_cache`` / ``save_cache_async`` — both group objects at ``N = len(token_ids)``, in
  one batch; ``publish`` writes through to Redis.
- ``restore_cache`` / ``restore_cache_async`` — a fresh ``DynamicCache`` that absorbed exactly
  ``token_ids``, from a ``SavedState`` or a ``LookupResult``. Both planned groups must be
  named (else ``NotFound``, before any load); each load states the expected key (this
  model's namespace, group and layers, prefix hash of ``token_ids``, span ``[0, N)``) so
  the daemon refuses any other object with its typed reason (another layer set:
  ``PlacementMismatch``). All layers or an error, never a part.
- ``lookup_state`` / ``lookup_restorable`` (+ ``_async``) — the daemon's joint hit over both
  groups with ``kv_layout="prefix"``: the largest restorable boundary among the block
  ends, ``len(token_ids)`` and any ``candidates``.
- The pure steps those calls are made of, for engines and the fault suite:
  ``check_client``, ``groups_of``, ``boundaries_for``, ``state_key``, ``put_items``,
  ``saved_from_refs``, ``saved_from_lookup``, ``expected_refs``, ``fill_cache``.

The client must be built with ``namespace=namespace_for(model)`` (``identity.py``); the
cache's layers are read and written by ``cache.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from statetier.protocol.errors import InvalidRequest, NotFound
from statetier.protocol.groups import LayerGroup
from statetier.protocol.identity import Kind, Namespace, NamespaceSpec, StateKey, StateRef, prefix_hash, prefix_hashes
from statetier.protocol.messages import ref_from_wire, ref_to_wire

from ..values import LookupResult, PutItem
from .cache import CachePlan, apply_kv, apply_ssm, cache_plan, device_of, kv_tensors, new_cache, ssm_tensors
from .identity import config_digest, namespace_for


@dataclass(frozen=True)
class SavedState:
    """What a save produced: the ref of the KV group object (``kv``) and of the SSM group
    object (``ssm``); ``None`` for a kind the model (or a partial state) lacks.

    ``request_id``/``step`` are ``None`` for a state assembled from a lookup, whose objects
    may come from several requests sharing the prefix.
    """

    tokens: int
    prefix_hash: bytes
    kv: StateRef | None = None
    ssm: StateRef | None = None
    request_id: str | None = None
    step: int | None = None

    def refs(self) -> list[StateRef]:
        return [ref for ref in (self.kv, self.ssm) if ref is not None]

    def to_json(self) -> str:
        return json.dumps({
            "tokens": self.tokens, "prefix_hash": self.prefix_hash.hex(), "request_id": self.request_id,
            "step": self.step, "kv": ref_to_wire(self.kv) if self.kv else None,
            "ssm": ref_to_wire(self.ssm) if self.ssm else None,
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SavedState":
        try:
            raw = json.loads(text)
            return cls(int(raw["tokens"]), bytes.fromhex(raw["prefix_hash"]),
                       ref_from_wire(raw["kv"]) if raw["kv"] is not None else None,
                       ref_from_wire(raw["ssm"]) if raw["ssm"] is not None else None,
                       raw.get("request_id"), raw.get("step"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidRequest(f"not a saved state: {exc}") from exc


# -- the pure steps ------------------------------------------------------------------------


def check_client(client, model) -> tuple[NamespaceSpec, Namespace]:
    """The client's namespace spec, refused unless it was built for ``model``'s config and dtype."""
    spec = getattr(client, "spec", None)
    if not isinstance(spec, NamespaceSpec):
        raise InvalidRequest("construct the client with namespace=namespace_for(model)")
    own = namespace_for(model, fingerprint="-")  # the weights digest is not compared here
    if not spec.revision.endswith(f"config:{config_digest(model.config)}") or spec.weight_dtype != own.weight_dtype \
            or spec.conv_layout != own.conv_layout:
        raise InvalidRequest("the client's namespace was not made by namespace_for(model) for this model")
    return spec, client.namespace


def groups_of(plan: CachePlan) -> dict[Kind, LayerGroup]:
    """The model's layer groups: every attention layer (KV), every SSM layer (SSM); group id 0."""
    layers = {Kind.KV: plan.attention_layers, Kind.SSM: plan.ssm_layers}
    return {kind: LayerGroup(kind, 0, tuple(found)) for kind, found in layers.items() if found}


def state_key(namespace: Namespace, group: LayerGroup, prefix: bytes, tokens: int) -> StateKey:
    """A KV group object spans ``[0, tokens)``; an SSM group object absorbed ``tokens`` tokens."""
    return group.key(namespace, prefix, 0, tokens)


def put_items(namespace: Namespace, spec: NamespaceSpec, plan: CachePlan, cache, token_ids: Sequence[int], *,
              request_id: str, step: int = 0, publish: bool = False) -> list[PutItem]:
    """The puts of one request's cache at ``len(token_ids)``: the KV group object, then the SSM one."""
    tokens = len(token_ids)
    if tokens == 0:
        raise InvalidRequest("a saved state absorbed at least one token")
    if len(cache.layers) != len(plan.layers):
        raise InvalidRequest(f"the cache has {len(cache.layers)} layers; the model {len(plan.layers)}")
    prefix = prefix_hash(list(token_ids), block_size=spec.kv_block_size, seed=spec.hash_seed)
    items = []
    for kind, group in groups_of(plan).items():
        if kind is Kind.KV:
            regions = {layer: kv_tensors(layer, cache.layers[layer], tokens) for layer in group.layers}
        else:
            regions = {layer: ssm_tensors(layer, cache.layers[layer], tokens) for layer in group.layers}
        items.append(PutItem(state_key(namespace, group, prefix, tokens), regions, request_id, step, publish))
    return items


def saved_from_refs(refs: Sequence[StateRef], *, request_id: str | None = None, step: int | None = None) -> SavedState:
    """The refs by kind (one group object each); ``tokens``/``prefix_hash`` from the first."""
    if not refs:
        raise NotFound("no state")
    first = refs[0].key
    found: dict[Kind, StateRef] = {}
    for ref in refs:
        if ref.key.kind in found:
            raise InvalidRequest(f"two {ref.key.kind.name} objects for one state")
        found[ref.key.kind] = ref
    return SavedState(first.token_end, first.prefix_hash, found.get(Kind.KV), found.get(Kind.SSM), request_id, step)


def saved_from_lookup(result: LookupResult) -> SavedState:
    if result.tokens == 0:
        raise NotFound("the joint-hit lookup found nothing restorable")
    return saved_from_refs(result.refs)


def expected_refs(namespace: Namespace, spec: NamespaceSpec, plan: CachePlan, source: SavedState,
                  token_ids: Sequence[int]) -> list[StateRef]:
    """What each load must find: this model's group key at ``len(token_ids)``, the handed
    state_id/version.

    Raises ``NotFound`` naming the missing layers when ``source`` lacks a planned group (a
    partial hit), and ``InvalidRequest`` when it names a kind of state the model lacks.
    """
    groups = groups_of(plan)
    handed = {Kind.KV: source.kv, Kind.SSM: source.ssm}
    missing = {kind: list(group.layers) for kind, group in groups.items() if handed[kind] is None}
    if missing:
        raise NotFound(f"partial state refused: KV missing for layers {missing.get(Kind.KV, [])}, "
                       f"SSM for layers {missing.get(Kind.SSM, [])}")
    extra = [kind.name for kind, ref in handed.items() if ref is not None and kind not in groups]
    if extra:
        raise InvalidRequest(f"state holds {' and '.join(extra)} objects, which this model has no layer for")
    tokens = len(token_ids)
    prefix = prefix_hash(list(token_ids), block_size=spec.kv_block_size, seed=spec.hash_seed)
    out = []
    for kind, group in groups.items():
        ref = handed[kind]
        assert ref is not None  # a planned group missing its ref was refused above
        request_id = source.request_id if source.request_id is not None else ref.request_id
        step = source.step if source.step is not None else ref.step
        out.append(StateRef(state_key(namespace, group, prefix, tokens), request_id, step, ref.state_id, ref.version))
    return out


def fill_cache(model, plan: CachePlan, tokens: int, loaded: Sequence[tuple[Kind, dict]]):
    """A fresh ``DynamicCache`` for ``model`` holding the loaded group objects' tensors
    (``{layer: {name: tensor}}`` per kind), moved to its device."""
    device = device_of(model)
    cache = new_cache(model.config)
    for kind, layers in loaded:
        for index, tensors in layers.items():
            tensors = {name: t.to(device) for name, t in tensors.items()}
            if kind is Kind.KV:
                apply_kv(plan.layer(index), cache.layers[index], tensors, tokens)
            else:
                apply_ssm(plan.layer(index), cache.layers[index], tensors, tokens)
    return cache


def boundaries_for(spec: NamespaceSpec, token_ids: Sequence[int],
                   candidates: Sequence[int] = ()) -> list[tuple[int, bytes]]:
    """Lookup boundaries: every full block end, ``len(token_ids)``, and any ``candidates``.

    A state saved at another length is found only when that length is a candidate, so an
    engine that wants its prefixes reused by longer requests saves at block ends.
    """
    tokens = list(token_ids)
    size, seed = spec.kv_block_size, spec.hash_seed
    bounds = {(i + 1) * size: h for i, h in enumerate(prefix_hashes(tokens, size, seed=seed))}
    for end in {len(tokens), *candidates} - set(bounds):
        if not 0 < end <= len(tokens):
            raise InvalidRequest(f"candidate boundary {end} is outside [1, {len(tokens)}]")
        bounds[end] = prefix_hash(tokens[:end], block_size=size, seed=seed)
    return sorted(bounds.items())


def _restore_plan(client, model, source, token_ids):
    spec, namespace = check_client(client, model)
    plan = cache_plan(model.config)
    saved = saved_from_lookup(source) if isinstance(source, LookupResult) else source
    if not isinstance(saved, SavedState):
        raise InvalidRequest(f"restore_cache takes a SavedState or a LookupResult, not {type(source).__name__}")
    return plan, expected_refs(namespace, spec, plan, saved, token_ids)


def _loaded(expected: list[StateRef], tensors: list[dict]) -> list[tuple[Kind, dict]]:
    return [(ref.key.kind, layers) for ref, layers in zip(expected, tensors)]


# -- blocking (Client) ---------------------------------------------------------------------


def save_cache(client, model, cache, token_ids: Sequence[int], *, request_id: str, step: int = 0,
               publish: bool = False) -> SavedState:
    """Store ``cache`` (which absorbed exactly ``token_ids``) for ``request_id``; see the module doc."""
    spec, namespace = check_client(client, model)
    items = put_items(namespace, spec, cache_plan(model.config), cache, token_ids, request_id=request_id,
                      step=step, publish=publish)
    return saved_from_refs(client.put_many(items), request_id=request_id, step=step)


def restore_cache(client, model, source: SavedState | LookupResult, token_ids: Sequence[int]):
    """A fresh ``DynamicCache`` that absorbed exactly ``token_ids``, or a typed error.

    A ``LookupResult``'s leases are released when this returns or raises.
    """
    try:
        plan, expected = _restore_plan(client, model, source, token_ids)
        tensors = client.load_many(expected)
        return fill_cache(model, plan, len(token_ids), _loaded(expected, tensors))
    finally:
        if isinstance(source, LookupResult) and source.lease_ids:
            client.release(source.lease_ids)


def lookup_state(client, model, token_ids: Sequence[int], *, candidates: Sequence[int] = (),
                 lease: bool = True) -> LookupResult:
    """The joint hit over ``model``'s KV and SSM groups (``kv_layout="prefix"``).

    The answer's objects stay leased until ``client.release(result.lease_ids)`` (or a
    ``restore_cache`` of the result) when ``lease`` is true.
    """
    spec, _ = check_client(client, model)
    groups = list(groups_of(cache_plan(model.config)).values())
    return client.lookup(boundaries=boundaries_for(spec, token_ids, candidates), groups=groups,
                         kv_layout="prefix", lease=lease)


def lookup_restorable(client, model, token_ids: Sequence[int], *, candidates: Sequence[int] = ()) -> int:
    """How many leading tokens of ``token_ids`` every layer can restore (0 when any is missing)."""
    return lookup_state(client, model, token_ids, candidates=candidates, lease=False).tokens


# -- asyncio (AsyncClient) -----------------------------------------------------------------


async def save_cache_async(client, model, cache, token_ids: Sequence[int], *, request_id: str, step: int = 0,
                           publish: bool = False) -> SavedState:
    spec, namespace = check_client(client, model)
    items = put_items(namespace, spec, cache_plan(model.config), cache, token_ids, request_id=request_id,
                      step=step, publish=publish)
    return saved_from_refs(await client.put_many(items), request_id=request_id, step=step)


async def restore_cache_async(client, model, source: SavedState | LookupResult, token_ids: Sequence[int]):
    try:
        plan, expected = _restore_plan(client, model, source, token_ids)
        tensors = await client.load_many(expected)
        return fill_cache(model, plan, len(token_ids), _loaded(expected, tensors))
    finally:
        if isinstance(source, LookupResult) and source.lease_ids:
            await client.release(source.lease_ids)


async def lookup_state_async(client, model, token_ids: Sequence[int], *, candidates: Sequence[int] = (),
                             lease: bool = True) -> LookupResult:
    spec, _ = check_client(client, model)
    groups = list(groups_of(cache_plan(model.config)).values())
    return await client.lookup(boundaries=boundaries_for(spec, token_ids, candidates), groups=groups,
                               kv_layout="prefix", lease=lease)


async def lookup_restorable_async(client, model, token_ids: Sequence[int], *, candidates: Sequence[int] = ()) -> int:
    return (await lookup_state_async(client, model, token_ids, candidates=candidates, lease=False)).tokens
