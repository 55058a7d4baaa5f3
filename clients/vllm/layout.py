"""What the vLLM connector knows of an engine and of its own settings; no vLLM, no torch.

- ``ConnectorConfig.from_extra(extra)`` — ``kv_connector_extra_config``: ``url`` (required:
  ``unix:///path/statetier.sock`` or ``tcp://host:port``), ``tenant``, ``token``, ``model_id``,
  ``model_fingerprint`` (else derived: ``weights.py``), ``allow_unidentified_weights``,
  ``publish``, ``audit_path``, ``timeout``, ``deadline`` (seconds an engine step may wait on
  the daemon: ``link.py``), ``save_decode_tokens`` (blocks of decoded tokens saved too, for a
  next turn; default: when vLLM's prefix caching is on and no speculative decoding),
  ``return_handoff`` (the handoff in a finished request's ``kv_transfer_params``; default:
  ``kv_producer`` only, ``contract.returns_handoff``). Unknown keys are refused.
- ``StateSpec`` / ``CacheGroup`` / ``EngineLayout`` — the engine's KV cache groups as plain
  values: an attention group (``Kind.KV``: block size, layers) or a Mamba group (``Kind.SSM``:
  one state slot per request, typed states ``conv``, ``recurrent``, …; ``is_replicated`` when
  every TP rank holds the same state, vLLM's ``MambaSpec.tp_replicated``: saved once, by rank 0,
  as shard 0, and loaded from that one object by every rank). The vLLM adapter
  (``connector.py``) builds them from ``kv_cache_config``; tests build them by hand.
- ``layer_id_of(name)`` — the layer index in a vLLM layer name (``model.layers.3.mixer`` → 3).
- ``namespace_spec(...)`` — the ``NamespaceSpec`` of an engine: model, config digest, weights
  fingerprint, dtypes, layout (engine tag, KV page and Mamba state shapes), TP size, tenant.
- ``stored_namespace(cfg, spec)`` — that namespace as the daemon stores it, taken into the
  tenant (``protocol.ownership``), in hex: what ``statetier ls`` shows, ``statetier purge``
  takes and the connector logs.

Statetier's boundaries are the attention groups' block ends; every attention group must
use the same block size, and a model needs at least one attention group.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.groups import LayerGroup
from statetier.protocol.identity import Kind, NamespaceSpec
from statetier.protocol.ownership import owned_namespace

#: The names of a Mamba layer's states in payload order (vLLM: conv state, then SSM state).
STATE_NAMES = ("conv", "recurrent")


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, from ``KVTransferConfig.kv_connector_extra_config``."""

    url: str
    tenant: str = "default"
    token: str | None = None
    model_id: str = ""            # default: vLLM's model (a path or a hub id)
    model_fingerprint: str = ""   # e.g. a hub commit or a digest of the weight files; "" = derived (weights.py)
    allow_unidentified_weights: bool = False  # run when no weights identity can be derived
    publish: bool = False         # write saves through to Redis (another node's consumer)
    audit_path: str = ""          # JSON lines: a digest of every page saved or loaded
    timeout: float = 30.0
    deadline: float = 1.0         # a lookup, load or save not answered within it is a miss (link.py)
    save_decode_tokens: bool | None = None  # blocks of decoded tokens too; None: when prefix caching is on
    events_endpoint: str = ""     # the daemon's KV event stream of this tenant: take_events() (events.py)
    events_topic: str = "{namespace}"  # the daemon's events.topic
    return_handoff: bool | None = None  # kv_transfer_params to the caller; None: with kv_role kv_producer only

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        raw = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequest(f"kv_connector_extra_config: unknown keys {unknown}; known: {sorted(known)}")
        if not isinstance(raw.get("url"), str) or not raw["url"]:
            raise InvalidRequest("kv_connector_extra_config: 'url' (the statetier daemon) is required")
        for name in ("tenant", "model_id", "model_fingerprint", "audit_path", "events_endpoint", "events_topic"):
            if name in raw and not isinstance(raw[name], str):
                raise InvalidRequest(f"kv_connector_extra_config: {name!r} must be a string")
        if raw.get("token") is not None and not isinstance(raw["token"], str):
            raise InvalidRequest("kv_connector_extra_config: 'token' must be a string")
        if raw.get("save_decode_tokens") is not None and not isinstance(raw["save_decode_tokens"], bool):
            raise InvalidRequest("kv_connector_extra_config: 'save_decode_tokens' must be true, false or null")
        if raw.get("return_handoff") is not None and not isinstance(raw["return_handoff"], bool):
            raise InvalidRequest("kv_connector_extra_config: 'return_handoff' must be true, false or null")
        for name in ("publish", "allow_unidentified_weights"):
            if name in raw and not isinstance(raw[name], bool):
                raise InvalidRequest(f"kv_connector_extra_config: {name!r} must be true or false")
        for name in ("timeout", "deadline"):
            value = raw.get(name)
            if name in raw and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise InvalidRequest(f"kv_connector_extra_config: {name!r} must be a positive number of seconds")
        return cls(**raw)


@dataclass(frozen=True)
class StateSpec:
    """One typed tensor of a cache page: ``dtype`` is a wire dtype name."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CacheGroup:
    """One vLLM KV cache group. ``layers`` are ``(layer name, layer id)`` pairs.

    Attention (``Kind.KV``): ``states`` is one ``kv`` spec of (kv heads, head size) for the
    namespace; a page is one block of ``block_size`` tokens. Mamba (``Kind.SSM``): one slot
    per request (its first block), ``states`` in the slot's byte order; in vLLM's align mode
    (``is_aligned``) one block per block end, and vLLM names the boundary states to save.
    ``is_replicated``: every TP rank holds the same state (vLLM's ``MambaSpec.tp_replicated``),
    stored once as shard 0 (``shard_of``), saved by rank 0 alone (``saved_by``).
    """

    index: int
    kind: Kind
    block_size: int
    layers: tuple[tuple[str, int], ...]
    states: tuple[StateSpec, ...] = ()
    is_aligned: bool = False  # Mamba in vLLM's "align" mode: one state block per block end, not one slot
    is_replicated: bool = False  # every TP rank holds the same state: one object, shard 0

    def shard_of(self, rank: int) -> int:
        """The shard of this group's objects a TP rank saves and loads: its own, or 0 when replicated."""
        return 0 if self.is_replicated else rank

    def saved_by(self, rank: int) -> bool:
        """Whether a TP rank saves this group's objects: every rank its own shard; rank 0 alone
        a replicated state."""
        return rank == 0 or not self.is_replicated

    def shard_count(self, tp_size: int) -> int:
        """How many shards hold this group's objects (0 … n-1): ``tp_size``, or 1 when replicated."""
        return 1 if self.is_replicated else tp_size

    def state_block(self, block_ids: Sequence[int], tokens: int, block_size: int) -> int:
        """The block holding this Mamba group's state after ``tokens`` tokens: the request's one
        slot, or in align mode the block of that boundary (vLLM allocates them by position)."""
        return block_ids[tokens // block_size - 1] if self.is_aligned else block_ids[0]

    @property
    def layer_group(self) -> LayerGroup:
        """The statetier group its objects are stored as: group id = vLLM's group index."""
        return LayerGroup(self.kind, self.index, tuple(lid for _, lid in self.layers))

    def name_of(self, layer_id: int) -> str:
        for name, lid in self.layers:
            if lid == layer_id:
                return name
        raise InvalidRequest(f"cache group {self.index} has no layer {layer_id}")


@dataclass(frozen=True)
class EngineLayout:
    groups: tuple[CacheGroup, ...]

    def __post_init__(self) -> None:
        attention = [g for g in self.groups if g.kind is Kind.KV]
        if not attention:
            raise InvalidRequest("the statetier connector needs at least one attention (KV) cache group")
        if len({g.block_size for g in attention}) != 1:
            raise InvalidRequest("every attention cache group must use the same block size")
        for kind in (Kind.KV, Kind.SSM):
            ids = [lid for g in self.groups if g.kind is kind for _, lid in g.layers]
            if len(ids) != len(set(ids)):
                raise InvalidRequest(f"two {kind.name} layers share a layer id: {sorted(ids)}")
        names = [name for g in self.groups for name, _ in g.layers]
        if len(names) != len(set(names)):
            raise InvalidRequest("a layer appears in two cache groups")

    @property
    def block_size(self) -> int:
        return next(g.block_size for g in self.groups if g.kind is Kind.KV)

    @property
    def attention_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.kind is Kind.KV)

    @property
    def mamba_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.kind is Kind.SSM)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(sorted(lid for g in self.attention_groups for _, lid in g.layers))

    @property
    def ssm_layers(self) -> tuple[int, ...]:
        return tuple(sorted(lid for g in self.mamba_groups for _, lid in g.layers))

    @property
    def has_several_groups(self) -> bool:
        """vLLM accepts failed block ids only from single-group layouts."""
        return len(self.groups) > 1

    def group(self, index: int) -> CacheGroup:
        for group in self.groups:
            if group.index == index:
                return group
        raise InvalidRequest(f"this engine has no cache group {index}")

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        return tuple(g.layer_group for g in self.groups)

    def group_shards(self, tp_size: int) -> tuple[int, ...]:
        """The shard count of each group of ``layer_groups`` (a lookup's ``group_shards``)."""
        return tuple(g.shard_count(tp_size) for g in self.groups)

    def group_of_key(self, key) -> CacheGroup:
        """The cache group an object's key fills: a group key's (the same kind and layers, else
        ``InvalidRequest``), or the group holding a per-layer key's layer."""
        if not key.group_layers:
            return self.group_of(key.kind, key.layer)[0]
        for group in self.groups:
            if group.index == key.layer and group.kind is key.kind:
                if group.layer_group.layers != tuple(key.group_layers):
                    raise InvalidRequest(f"cache group {group.index} holds layers {group.layer_group.layers}, "
                                         f"the object {tuple(key.group_layers)}")
                return group
        raise InvalidRequest(f"this engine has no {key.kind.name} cache group {key.layer}")

    def group_of(self, kind: Kind, layer_id: int) -> tuple[CacheGroup, str]:
        """The group and layer name holding ``kind`` state of ``layer_id``."""
        for group in self.groups:
            if group.kind is kind:
                for name, lid in group.layers:
                    if lid == layer_id:
                        return group, name
        raise InvalidRequest(f"this engine has no {kind.name} layer {layer_id}")


_INTEGER = re.compile(r"\d+")


def layer_id_of(name: str) -> int:
    """The one integer in a vLLM layer name (``model.layers.12.self_attn.attn`` → 12)."""
    found = _INTEGER.findall(name)
    if len(found) != 1:
        raise InvalidRequest(f"cannot tell the layer index of {name!r}: expected exactly one number in it")
    return int(found[0])


def namespace_spec(cfg: ConnectorConfig, layout: EngineLayout, *, model: str, revision: str, config_digest: str,
                   weight_dtype: str, tp_size: int, engine_tag: str) -> NamespaceSpec:
    """The namespace two engines must share to exchange state (DESIGN §2).

    ``engine_tag`` names the engine, its version and device kind (``vllm-0.32/cpu``): the
    page layout of the paged buffers and of the Mamba states is theirs.
    """
    identity = [revision, f"config:{config_digest}"]
    if cfg.model_fingerprint:
        identity.append(f"weights:{cfg.model_fingerprint}")
    kv = sorted({(s.dtype, s.shape) for g in layout.attention_groups for s in g.states})
    mamba = sorted({(s.name, s.dtype, s.shape) for g in layout.mamba_groups for s in g.states})
    dtype_of = {name: dtype for name, dtype, _ in mamba}
    layout_text = ";".join([engine_tag, *(f"kv:{d}{list(s)}" for d, s in kv),
                            *(f"{n}:{d}{list(s)}" for n, d, s in mamba)])
    return NamespaceSpec(
        model_id=_fit(cfg.model_id or model),
        revision=_fit(";".join(part for part in identity if part)),
        weight_dtype=weight_dtype,
        kv_block_size=layout.block_size,
        kv_dtype=",".join(sorted({d for d, _ in kv})),
        ssm_dtype=dtype_of.get("recurrent", ""),
        conv_dtype=dtype_of.get("conv", ""),
        conv_layout=_fit(layout_text),
        tp_size=tp_size,
        tenant=cfg.tenant,
    )


def stored_namespace(cfg: ConnectorConfig, spec: NamespaceSpec) -> str:
    """The namespace's one spelling: as the daemon keeps it for ``cfg.tenant`` (hex)."""
    return owned_namespace(cfg.tenant, spec.namespace()).hex()


def _fit(text: str) -> str:
    """``text``, or its digest when it is longer than a namespace field holds (255 bytes)."""
    if len(text.encode()) <= 255:
        return text
    return "blake2b:" + hashlib.blake2b(text.encode(), digest_size=32).hexdigest()
