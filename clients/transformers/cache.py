"""The cache layers of a Hugging Face transformers (5.x) model, read and written as records.

A ``DynamicCache(config)`` holds one layer object per model layer. What a layer object
keeps is found by inspecting it, not by its model: an attention part (``keys``/``values``,
``CacheLayerMixin``), a linear-attention/SSM part (``conv_states``/``recurrent_states``
dicts of ``number_of_states`` entries, ``LinearAttentionCacheLayerMixin``), both (Zamba's
and Falcon-H1's hybrid layers), or nothing (``DummyLayer``: MLP/MoE-only layers).

- ``cache_plan(config)`` → ``CachePlan``: per layer, whether it has KV and/or SSM state
  (``attention_layers``, ``ssm_layers``); read from a fresh ``DynamicCache(config)``.
- ``kv_tensors(index, layer, tokens)`` / ``ssm_tensors(index, layer, tokens)`` — a layer's state as
  ``{name: tensor}`` (``keys``, ``values``; ``conv_states.<i>``, ``recurrent_states.<i>``), refusing
  layers that hold tensors this module does not know how to restore (by name), or whose
  position counters are not at ``tokens`` (``PositionMismatch``).
- ``apply_kv(plan, layer, tensors, tokens)`` / ``apply_ssm(plan, layer, tensors, tokens)`` — write
  them into a fresh layer object through the layer's own update methods, exactly, and set the
  layer's position counters from ``tokens``.
- ``TENSOR_TABLE`` — every tensor attribute a layer may hold and what it is (state, derived
  from the config, or a position counter); ``CHECKED_ON``, the transformers releases it was read
  against (their ``cache_utils.py`` whole). Anything else is refused by name, never dropped.
- ``Quirks`` / ``quirks_for(config)`` — the per-architecture table (``QUIRKS``).
- ``forward_from(model, cache, token_ids, position)`` — run tokens on a cache that already
  absorbed ``position`` tokens, honouring the quirks; returns the last token's logits.
- ``new_cache(config)`` (a fresh ``DynamicCache``), ``device_of(model)``.

Imports transformers lazily (on the first call), never at module import.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import torch

from statetier.protocol.errors import CorruptPayload, InvalidRequest, PositionMismatch

KV_NAMES = ("keys", "values")
CONV = "conv_states"
RECURRENT = "recurrent_states"
#: The linear-attention layers' token count (transformers 5.25+): zeroed on reset,
#: ``+= conv_states.shape[-1]`` on prefill, ``+= 1`` per decoded token; a function of the
#: snapshot's position, so it is checked against ``tokens`` on save and set from it on restore.
LINEAR_COUNTER = "cumulative_length_linear"

#: The transformers releases whose ``cache_utils.py`` (every layer class) ``TENSOR_TABLE`` was
#: read against, and the tests run on (tests/clients/test_transformers_adapter.py). A new
#: release's new tensor is refused by name until it is read and added here.
CHECKED_ON = ("5.24.0", "5.25.0")

#: Every tensor attribute (or dict of tensors) a cache layer may hold, and what it is:
#: ``state`` is saved and restored; ``derived`` comes from the config and is rebuilt by a fresh
#: layer; ``position`` is a token count that must equal the snapshot's ``tokens``.
TENSOR_TABLE: dict[str, str] = {
    "keys": "state", "values": "state", CONV: "state", RECURRENT: "state",
    "_sliding_window_tensor": "derived",
    LINEAR_COUNTER: "position",
}


@dataclass(frozen=True, slots=True)
class Quirks:
    """What running a restored cache needs beyond ``model(input_ids, cache=…)``.

    ``one_token_per_forward``: a forward of several tokens on a non-empty cache ignores the
    recurrent state (Mamba-1 mixers in transformers 5.x); feed such tokens one by one.
    ``explicit_positions``: the model's default ``position_ids`` ignore the cache; pass them.
    """

    one_token_per_forward: bool = False
    explicit_positions: bool = False


#: Measured on transformers 5.x with tiny random models (docs/integration.md).
QUIRKS: dict[str, Quirks] = {
    "jamba": Quirks(one_token_per_forward=True),
    "zamba": Quirks(one_token_per_forward=True),
    "mamba": Quirks(one_token_per_forward=True),
    "falcon_mamba": Quirks(one_token_per_forward=True),
    "bamba": Quirks(explicit_positions=True),
}


def quirks_for(config) -> Quirks:
    return QUIRKS.get(getattr(config, "model_type", ""), Quirks())


@dataclass(frozen=True, slots=True)
class LayerPlan:
    index: int
    has_kv: bool
    has_ssm: bool
    states: int = 0  # number_of_states of the SSM part
    sliding: bool = False


@dataclass(frozen=True, slots=True)
class CachePlan:
    layers: tuple[LayerPlan, ...]

    @property
    def attention_layers(self) -> list[int]:
        return [p.index for p in self.layers if p.has_kv]

    @property
    def ssm_layers(self) -> list[int]:
        return [p.index for p in self.layers if p.has_ssm]

    def layer(self, index: int) -> LayerPlan:
        return self.layers[index]


def new_cache(config):
    """A fresh ``DynamicCache`` for ``config``'s layer structure."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def cache_plan(config) -> CachePlan:
    """Which layers carry KV and SSM state, read from a fresh (empty, cheap) cache."""
    return CachePlan(tuple(_layer_plan(i, layer) for i, layer in enumerate(new_cache(config).layers)))


def _layer_plan(index: int, layer) -> LayerPlan:
    from transformers.cache_utils import CacheLayerMixin, DummyLayer, LinearAttentionCacheLayerMixin

    if isinstance(layer, DummyLayer):
        return LayerPlan(index, False, False)
    has_kv = isinstance(layer, CacheLayerMixin)
    has_ssm = isinstance(layer, LinearAttentionCacheLayerMixin)
    if not (has_kv or has_ssm):
        raise InvalidRequest(f"cache layer {index} is a {type(layer).__name__}, which statetier cannot save")
    return LayerPlan(index, has_kv, has_ssm, getattr(layer, "number_of_states", 0) if has_ssm else 0,
                     bool(getattr(layer, "is_sliding", False)))


# -- reading a layer ---------------------------------------------------------------------


def _holds_tensors(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False


def _check_known_tensors(index: int, layer) -> None:
    for name, value in vars(layer).items():
        if _holds_tensors(value) and name not in TENSOR_TABLE:
            raise InvalidRequest(f"cache layer {index} ({type(layer).__name__}) holds tensor {name!r}, which "
                                 f"statetier does not know how to restore (its tensor table was read on "
                                 f"transformers {', '.join(CHECKED_ON)})")


def _check_position(index: int, what: str, absorbed: int, tokens: int) -> None:
    if absorbed != tokens:
        raise PositionMismatch(f"{what} layer {index} absorbed {absorbed} tokens, not {tokens}")


def _check_linear_counter(index: int, layer, tokens: int) -> None:
    counter = getattr(layer, LINEAR_COUNTER, None)
    if counter is not None:
        _check_position(index, "SSM", int(counter), tokens)


def kv_tensors(index: int, layer, tokens: int) -> dict[str, torch.Tensor]:
    """``{"keys", "values"}`` of an attention layer that absorbed exactly ``tokens`` tokens."""
    _check_known_tensors(index, layer)
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)) or keys.numel() == 0:
        raise InvalidRequest(f"attention layer {index} holds no keys/values")
    if getattr(layer, "record_past", False):
        raise InvalidRequest(f"attention layer {index} records past states; crop the cache first")
    if keys.shape[0] != 1:
        raise InvalidRequest(f"attention layer {index} has batch {keys.shape[0]}; a request is one sequence")
    # a hybrid layer's get_seq_length is its attention part's (5.24: by inheritance, 5.25: declared)
    _check_position(index, "attention", int(layer.get_seq_length()), tokens)
    return {"keys": keys, "values": values}


def ssm_tensors(index: int, layer, tokens: int) -> dict[str, torch.Tensor]:
    """``conv_states.<i>`` / ``recurrent_states.<i>`` of every initialised state of a layer that
    absorbed exactly ``tokens`` tokens (where the layer counts them)."""
    _check_known_tensors(index, layer)
    if layer.record_past:
        raise InvalidRequest(f"SSM layer {index} records past conv states; crop the cache first")
    _check_linear_counter(index, layer, tokens)
    out: dict[str, torch.Tensor] = {}
    for i in range(layer.number_of_states):
        conv, recurrent = layer.conv_states[i], layer.recurrent_states[i]
        if conv is None and recurrent is None:
            continue
        if not layer.has_previous_state[i]:
            raise InvalidRequest(f"SSM layer {index} state {i} has absorbed no tokens")
        for name, tensor in ((CONV, conv), (RECURRENT, recurrent)):
            if tensor is not None:
                if tensor.shape[0] != 1:
                    raise InvalidRequest(f"SSM layer {index} has batch {tensor.shape[0]}; a request is one sequence")
                out[f"{name}.{i}"] = tensor
    if not out:
        raise InvalidRequest(f"SSM layer {index} holds no state")
    return out


# -- writing a layer ---------------------------------------------------------------------


def apply_kv(plan: LayerPlan, layer, tensors: dict[str, torch.Tensor], tokens: int) -> None:
    """Fill a fresh attention layer with ``keys``/``values`` covering ``[0, tokens)``."""
    if sorted(tensors) != sorted(KV_NAMES):
        raise CorruptPayload(f"KV record of layer {plan.index} holds {sorted(tensors)}, not keys and values")
    keys, values = tensors["keys"], tensors["values"]
    held = keys.shape[-2] if keys.dim() >= 2 else -1
    if keys.dim() != 4 or keys.shape[0] != 1 or values.shape[:-1] != keys.shape[:-1] or \
            (held != tokens and not plan.sliding) or held > tokens:
        raise CorruptPayload(f"KV record of layer {plan.index} has shapes {tuple(keys.shape)}/{tuple(values.shape)}, "
                             f"which do not cover {tokens} tokens")
    layer.update(keys, values)
    if hasattr(layer, "cumulative_length"):  # sliding-window layers keep only the window
        layer.cumulative_length = tokens


def apply_ssm(plan: LayerPlan, layer, tensors: dict[str, torch.Tensor], tokens: int) -> None:
    """Fill a fresh SSM layer with its conv and recurrent states, marked as having absorbed
    ``tokens`` tokens (the layer's token counter, where it keeps one, set to ``tokens``)."""
    expected = {f"{name}.{i}" for i in range(plan.states) for name in (CONV, RECURRENT)}
    unknown = set(tensors) - expected
    if unknown or not tensors:
        raise CorruptPayload(f"SSM snapshot of layer {plan.index} holds {sorted(tensors)}; "
                             f"a layer of {plan.states} state(s) takes {sorted(expected)}")
    for i in range(plan.states):
        conv, recurrent = tensors.get(f"{CONV}.{i}"), tensors.get(f"{RECURRENT}.{i}")
        if conv is not None:
            layer.update_conv_state(conv, state_idx=i, conv_kernel_size=conv.shape[-1])
        if recurrent is not None:
            layer.update_recurrent_state(recurrent, state_idx=i)
        if conv is not None or recurrent is not None:
            layer.has_previous_state[i] = True
    counter = getattr(layer, LINEAR_COUNTER, None)
    if isinstance(counter, torch.Tensor):  # the conv update above counted the kernel's width
        counter.fill_(tokens)


# -- running a cache ---------------------------------------------------------------------


def forward_from(model, cache, token_ids: Sequence[int], position: int) -> torch.Tensor:
    """Feed ``token_ids`` to ``model`` on ``cache`` (which holds ``position`` tokens).

    Returns the logits after the last token (1-D). Applies ``quirks_for(model.config)``;
    position ids are passed whenever the model's forward takes them.
    """
    if not token_ids:
        raise InvalidRequest("forward_from needs at least one token")
    quirks = quirks_for(model.config)
    step = 1 if quirks.one_token_per_forward and position > 0 else len(token_ids)
    takes_positions, cache_arg = _forward_args(model)
    if quirks.explicit_positions and not takes_positions:
        raise InvalidRequest(f"{type(model).__name__} needs explicit positions but its forward takes none")
    device = device_of(model)
    logits = None
    with torch.no_grad():
        for start in range(0, len(token_ids), step):
            chunk = list(token_ids[start : start + step])
            kwargs = {"input_ids": torch.tensor([chunk], device=device), cache_arg: cache, "use_cache": True}
            if takes_positions:
                begin = position + start
                kwargs["position_ids"] = torch.arange(begin, begin + len(chunk), device=device)[None]
            logits = model(**kwargs).logits[0, -1]
    return logits


def device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _forward_args(model) -> tuple[bool, str]:
    """Whether ``forward`` takes ``position_ids``, and the name of its cache argument."""
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    return "position_ids" in params, cache_arg
