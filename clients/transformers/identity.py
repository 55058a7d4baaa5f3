"""Who a Hugging Face transformers model is, as a statetier namespace (DESIGN §2).

- ``weights_fingerprint(model)`` — BLAKE2b-256 over every ``state_dict`` entry (name, dtype,
  shape, bytes), hex. Computed once per model object and cached: a model whose weights are
  changed in place afterwards must be given a new object (or an explicit ``fingerprint``).
- ``config_digest(config)`` — BLAKE2b-128 over the model config's JSON, minus the keys that
  do not change the state (name, transformers version, output switches), hex.
- ``namespace_for(model, *, kv_block_size, revision, tenant, hash_seed, fingerprint)`` →
  ``NamespaceSpec``: model id (config name or model type), ``revision`` =
  ``[revision;]weights:<fingerprint>;config:<digest>``, weight dtype, quantization method,
  KV/SSM/conv dtypes, the conv layout of this transformers minor version, tp size 1.

Two models with other weights, another config (layer layout, head counts, state sizes) or
another dtype get different namespaces, so the daemon refuses to hand one's state to the other.
"""

from __future__ import annotations

import hashlib
import json
import struct
import weakref

import torch

from statetier.protocol.identity import NamespaceSpec

from ..tensors import byte_view, dtype_name, tensor_bytes

#: transformers keeps a conv state as (batch, channels, kernel window), newest column last.
CONV_ORIENTATION = "(batch,channels,window)"
_VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "architectures", "output_hidden_states", "output_attentions",
    "return_dict", "use_cache", "_attn_implementation", "_attn_implementation_autoset", "_commit_hash",
})
_fingerprints: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """The BLAKE2b-256 hex digest of ``model``'s weights (cached per model object)."""
    cached = _fingerprints.get(model)
    if cached is not None:
        return cached
    digest = hashlib.blake2b(b"statetier/weights/1", digest_size=32)
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        digest.update(_lp(name.encode()) + _lp(dtype_name(tensor.dtype).encode()))
        digest.update(struct.pack(f"<I{tensor.dim()}Q", tensor.dim(), *tensor.shape))
        if tensor.numel():
            digest.update(byte_view(tensor_bytes(tensor.cpu())))
    text = digest.hexdigest()
    _fingerprints[model] = text
    return text


def config_digest(config) -> str:
    """BLAKE2b-128 hex over the state-relevant part of the model config."""
    items = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    text = json.dumps(items, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def namespace_for(model: torch.nn.Module, *, kv_block_size: int = 16, revision: str = "", tenant: str = "",
                  hash_seed: int = 0, fingerprint: str | None = None) -> NamespaceSpec:
    """The ``NamespaceSpec`` under which ``model``'s states are stored and loaded."""
    import transformers

    config = model.config
    dtype = dtype_name(_weight_dtype(model))
    model_id = (getattr(config, "_name_or_path", "") or getattr(config, "model_type", "") or type(model).__name__)
    identity = f"weights:{fingerprint or weights_fingerprint(model)};config:{config_digest(config)}"
    quantization = getattr(config, "quantization_config", None)
    method = (quantization.get("quant_method", "") if isinstance(quantization, dict)
              else str(getattr(quantization, "quant_method", "") or "")) if quantization else ""
    major_minor = ".".join(transformers.__version__.split(".")[:2])
    return NamespaceSpec(
        model_id=model_id[-255:],
        revision=f"{revision};{identity}" if revision else identity,
        weight_dtype=dtype,
        quantization=method,
        kv_block_size=kv_block_size,
        kv_dtype=dtype,
        ssm_dtype=dtype,
        conv_dtype=dtype,
        conv_layout=f"transformers-{major_minor}:{CONV_ORIENTATION}",
        tp_size=1,
        hash_seed=hash_seed,
        tenant=tenant,
    )


def _weight_dtype(model: torch.nn.Module) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for parameter in model.parameters():
        return parameter.dtype
    return torch.float32


def _lp(raw: bytes) -> bytes:
    return struct.pack("<I", len(raw)) + raw
