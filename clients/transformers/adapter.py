"""Save, look up and restore a Hugging Face hybrid cache through a statetier client.

- ``SavedState`` — refs by layer (``kv``, ``ssm``), ``tokens`` absorbed, prefix hash, request
  id and step; ``to_json`` / ``from_json`` for the handoff.
- ``save_cache`` / ``save_cache_async`` — one KV record per attention layer covering
  ``[0, N)`` and one SSM snapshot per SSM layer (conv + recurrent states) at ``N =
  len(token_ids)``, in one batch; ``publish`` writes through to Redis.
- ``restore_cache`` / ``restore_cache_async`` — a fresh ``DynamicCache`` that absorbed exactly
  ``token_ids``, from a ``SavedState`` or a ``LookupResult``. Every planned layer must be
  named (else ``NotFound``, before any load); each load states the expected key (this
  model's namespace, layer, prefix hash of ``token_ids``, span ``[0, N)``) so the daemon
  refuses any other object with its typed reason. All layers or an error, never a part.
- ``lookup_state`` / ``lookup_restorable`` (+ ``_async``) — the daemon's joint hit with
  ``kv_layout="prefix"``: the largest restorable boundary among the block ends,
  ``len(token_ids)`` and any ``candidates``.
- The pure steps those calls are made of, for engines and the fault suite:
  ``check_client``, ``boundaries_for``, ``state_key``, ``put_items``, ``saved_from_refs``,
  ``saved_from_lookup``, ``expected_refs``, ``fill_cache``.

The client must be built with ``namespace=namespace_for(model)`` (``identity.py``); the
cache's layers are read and written by ``cache.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

from statetier.protocol.errors import InvalidRequest, NotFound
from statetier.protocol.identity import Kind, Namespace, NamespaceSpec, StateKey, StateRef, prefix_hash, prefix_hashes
from statetier.protocol.messages import ref_from_wire, ref_to_wire

from ..values import LookupResult, PutItem
from .cache import CachePlan, LayerPlan, apply_kv, apply_ssm, cache_plan, device_of, kv_tensors, new_cache, ssm_tensors
from .identity import config_digest, namespace_for


@dataclass(frozen=True)
class SavedState:
    """What a save produced: one ref per attention layer (``kv``) and per SSM layer (``ssm``).

    ``request_id``/``step`` are ``None`` for a state assembled from a lookup, whose objects
    may come from several requests sharing the prefix.
    """

    tokens: int
    prefix_hash: bytes
    kv: dict[int, StateRef] = field(default_factory=dict)
    ssm: dict[int, StateRef] = field(default_factory=dict)
    request_id: str | None = None
    step: int | None = None

    def refs(self) -> list[StateRef]:
        return [*self.kv.values(), *self.ssm.values()]

    def to_json(self) -> str:
        return json.dumps({
            "tokens": self.tokens, "prefix_hash": self.prefix_hash.hex(), "request_id": self.request_id,
            "step": self.step, "kv": {str(k): ref_to_wire(r) for k, r in self.kv.items()},
            "ssm": {str(k): ref_to_wire(r) for k, r in self.ssm.items()},
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SavedState":
        try:
            raw = json.loads(text)
            return cls(int(raw["tokens"]), bytes.fromhex(raw["prefix_hash"]),
                       {int(k): ref_from_wire(v) for k, v in raw["kv"].items()},
                       {int(k): ref_from_wire(v) for k, v in raw["ssm"].items()},
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


def state_key(namespace: Namespace, kind: Kind, layer: int, prefix: bytes, tokens: int) -> StateKey:
    """A KV record spans ``[0, tokens)``; an SSM snapshot absorbed ``tokens`` tokens."""
    return StateKey(namespace, kind, layer, prefix, 0, tokens)


def put_items(namespace: Namespace, spec: NamespaceSpec, plan: CachePlan, cache, token_ids: Sequence[int], *,
              request_id: str, step: int = 0, publish: bool = False) -> list[PutItem]:
    """The puts of one request's cache at ``len(token_ids)``: KV layers first, then SSM layers."""
    tokens = len(token_ids)
    if tokens == 0:
        raise InvalidRequest("a saved state absorbed at least one token")
    if len(cache.layers) != len(plan.layers):
        raise InvalidRequest(f"the cache has {len(cache.layers)} layers; the model {len(plan.layers)}")
    prefix = prefix_hash(list(token_ids), block_size=spec.kv_block_size, seed=spec.hash_seed)
    items = []
    for layer in plan.attention_layers:
        tensors = kv_tensors(layer, cache.layers[layer], tokens)
        items.append(PutItem(state_key(namespace, Kind.KV, layer, prefix, tokens), tensors, request_id, step, publish))
    for layer in plan.ssm_layers:
        tensors = ssm_tensors(layer, cache.layers[layer])
        items.append(PutItem(state_key(namespace, Kind.SSM, layer, prefix, tokens), tensors, request_id, step, publish))
    return items


def saved_from_refs(refs: Sequence[StateRef], *, request_id: str | None = None, step: int | None = None) -> SavedState:
    """Group refs by kind and layer (one per layer); ``tokens``/``prefix_hash`` from the first."""
    if not refs:
        raise NotFound("no state")
    first = refs[0].key
    kv: dict[int, StateRef] = {}
    ssm: dict[int, StateRef] = {}
    for ref in refs:
        slot = kv if ref.key.kind is Kind.KV else ssm
        if ref.key.layer in slot:
            raise InvalidRequest(f"two {ref.key.kind.name} objects for layer {ref.key.layer}")
        slot[ref.key.layer] = ref
    return SavedState(first.token_end, first.prefix_hash, kv, ssm, request_id, step)


def saved_from_lookup(result: LookupResult) -> SavedState:
    if result.tokens == 0:
        raise NotFound("the joint-hit lookup found nothing restorable")
    return saved_from_refs(result.refs)


def expected_refs(namespace: Namespace, spec: NamespaceSpec, plan: CachePlan, source: SavedState,
                  token_ids: Sequence[int]) -> list[tuple[LayerPlan, StateRef]]:
    """What each load must find: this model's key at ``len(token_ids)``, the handed state_id/version.

    Raises ``NotFound`` naming the missing layers when ``source`` does not cover every
    planned layer (a partial hit), and ``InvalidRequest`` when it names layers the model lacks.
    """
    missing_kv = sorted(set(plan.attention_layers) - set(source.kv))
    missing_ssm = sorted(set(plan.ssm_layers) - set(source.ssm))
    if missing_kv or missing_ssm:
        raise NotFound(f"partial state refused: KV missing for layers {missing_kv}, SSM for layers {missing_ssm}")
    extra = sorted((set(source.kv) - set(plan.attention_layers)) | (set(source.ssm) - set(plan.ssm_layers)))
    if extra:
        raise InvalidRequest(f"state names layers {extra}, which hold no such state in this model")
    tokens = len(token_ids)
    prefix = prefix_hash(list(token_ids), block_size=spec.kv_block_size, seed=spec.hash_seed)
    out = []
    for kind, refs in ((Kind.KV, source.kv), (Kind.SSM, source.ssm)):
        for layer in sorted(refs):
            ref = refs[layer]
            request_id = source.request_id if source.request_id is not None else ref.request_id
            step = source.step if source.step is not None else ref.step
            key = state_key(namespace, kind, layer, prefix, tokens)
            out.append((plan.layer(layer), StateRef(key, request_id, step, ref.state_id, ref.version)))
    return out


def fill_cache(model, plan: CachePlan, tokens: int, loaded: Sequence[tuple[LayerPlan, Kind, dict]]):
    """A fresh ``DynamicCache`` for ``model`` holding the loaded tensors (moved to its device)."""
    device = device_of(model)
    cache = new_cache(model.config)
    for layer_plan, kind, tensors in loaded:
        tensors = {name: t.to(device) for name, t in tensors.items()}
        layer = cache.layers[layer_plan.index]
        if kind is Kind.KV:
            apply_kv(layer_plan, layer, tensors, tokens)
        else:
            apply_ssm(layer_plan, layer, tensors)
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


def _loaded(expected, tensors) -> list[tuple[LayerPlan, Kind, dict]]:
    return [(layer_plan, ref.key.kind, t) for (layer_plan, ref), t in zip(expected, tensors)]


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
        tensors = client.load_many([ref for _, ref in expected])
        return fill_cache(model, plan, len(token_ids), _loaded(expected, tensors))
    finally:
        if isinstance(source, LookupResult) and source.lease_ids:
            client.release(source.lease_ids)


def lookup_state(client, model, token_ids: Sequence[int], *, candidates: Sequence[int] = (),
                 lease: bool = True) -> LookupResult:
    """The joint hit over every KV and SSM layer of ``model`` (``kv_layout="prefix"``).

    The answer's objects stay leased until ``client.release(result.lease_ids)`` (or a
    ``restore_cache`` of the result) when ``lease`` is true.
    """
    spec, _ = check_client(client, model)
    plan = cache_plan(model.config)
    return client.lookup(plan.attention_layers, plan.ssm_layers, boundaries_for(spec, token_ids, candidates),
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
        tensors = await client.load_many([ref for _, ref in expected])
        return fill_cache(model, plan, len(token_ids), _loaded(expected, tensors))
    finally:
        if isinstance(source, LookupResult) and source.lease_ids:
            await client.release(source.lease_ids)


async def lookup_state_async(client, model, token_ids: Sequence[int], *, candidates: Sequence[int] = (),
                             lease: bool = True) -> LookupResult:
    spec, _ = check_client(client, model)
    plan = cache_plan(model.config)
    return await client.lookup(plan.attention_layers, plan.ssm_layers, boundaries_for(spec, token_ids, candidates),
                               kv_layout="prefix", lease=lease)


async def lookup_restorable_async(client, model, token_ids: Sequence[int], *, candidates: Sequence[int] = ()) -> int:
    return (await lookup_state_async(client, model, token_ids, candidates=candidates, lease=False)).tokens
