"""Real hybrid-model geometries, as the state one request leaves behind (synthetic values).

- ``Model`` — a frozen geometry: attention layers with ``kv_heads`` × ``head_dim`` KV heads,
  SSM / GDN layers with their ``conv`` and recurrent (``ssm``) state shapes and dtypes,
  and ``assumption`` (what the brief did not pin down, stated in the report).
- ``MODELS`` — Jamba-mini, Nemotron-H-8B, Qwen3-Next-80B (``by_name``).
- ``Model.state_bytes(tokens)`` — payload bytes of one request's whole state at ``tokens``.
- ``request_state(model, tokens, seed)`` → ``RequestState``: one KV record per attention
  layer (``k`` and ``v``, ``(kv_heads, tokens, head_dim)``, covering ``[0, tokens)``) and one
  snapshot per SSM layer (``conv`` + ``ssm``), as random bits of the right dtypes.
- ``kv_block(model, block_tokens, seed)`` / ``ssm_snapshot(model, seed)`` — one layer's KV
  page of a block and one layer's SSM snapshot, for workloads that assemble their own.
- ``Model.prefill_flops(tokens)`` — the forward FLOPs of a prefill of ``tokens`` (2 × active
  parameters per token + causal attention over the attention layers), from the published
  parameter counts in ``active_params`` / ``attention_width``.

Layer positions follow each model's published interleaving as far as it is known; only
the counts and shapes matter for the bytes moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Model:
    name: str
    display: str
    attention_layers: tuple[int, ...]
    ssm_layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    conv_shape: tuple[int, ...]
    conv_dtype: str
    ssm_shape: tuple[int, ...]
    ssm_dtype: str
    kv_dtype: str = "bfloat16"
    assumption: str = ""
    active_params: float = 0.0  # parameters one token passes through (MoE: the active ones)
    attention_width: int = 0  # query heads × head_dim of an attention layer
    params_source: str = ""

    def kv_bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype] * len(self.attention_layers)

    def snapshot_bytes(self) -> int:
        one = (_numel(self.conv_shape) * DTYPE_BYTES[self.conv_dtype]
               + _numel(self.ssm_shape) * DTYPE_BYTES[self.ssm_dtype])
        return one * len(self.ssm_layers)

    def state_bytes(self, tokens: int) -> int:
        return self.kv_bytes_per_token() * tokens + self.snapshot_bytes()

    def prefill_flops(self, tokens: int) -> float:
        """2·P_active·N for the weights, plus 2·N²·width per attention layer (QKᵀ and AV, causal)."""
        return 2.0 * self.active_params * tokens + 2.0 * len(self.attention_layers) * tokens ** 2 * self.attention_width

    def describe(self) -> str:
        return (f"{len(self.ssm_layers)} SSM layers × conv {self.conv_shape} {self.conv_dtype} + ssm {self.ssm_shape} "
                f"{self.ssm_dtype}; {len(self.attention_layers)} attention layers × {self.kv_heads} KV heads × "
                f"{self.head_dim} {self.kv_dtype}")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _split(total: int, attention: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(attention), tuple(i for i in range(total) if i not in attention)


_JAMBA = _split(32, [4, 12, 20, 28])  # attn_layer_period 8, offset 4
_NEMOTRON = _split(28, [6, 13, 20, 27])  # the 28 layers that hold state (24 Mamba-2 + 4 attention)
_QWEN3_NEXT = _split(48, list(range(3, 48, 4)))  # full_attention_interval 4

MODELS = (
    Model("jamba-mini", "Jamba-mini", *_JAMBA, kv_heads=8, head_dim=128, conv_shape=(3, 8192), conv_dtype="bfloat16",
          ssm_shape=(8192, 16), ssm_dtype="float32",
          assumption="conv state bfloat16, recurrent state float32 (as benchmarks/seal.py)",
          active_params=12e9, attention_width=32 * 128,
          params_source="AI21 Jamba Mini 1.7: 52B parameters, 12B active; 32 query heads × 128"),
    Model("nemotron-h-8b", "Nemotron-H-8B", *_NEMOTRON, kv_heads=8, head_dim=128, conv_shape=(3, 10240),
          conv_dtype="float32", ssm_shape=(128, 64, 128), ssm_dtype="float32",
          assumption="4 attention layers of 8 KV heads × head_dim 128 in bfloat16 (the published 8B config: "
                     "32 query heads, GQA with 8 KV heads, 4 of 52 layers attention); MLP-only layers hold no state",
          active_params=8e9, attention_width=32 * 128,
          params_source="NVIDIA Nemotron-H-8B: 8B parameters, dense; 32 query heads × 128"),
    Model("qwen3-next-80b", "Qwen3-Next-80B", *_QWEN3_NEXT, kv_heads=2, head_dim=256, conv_shape=(3, 8192),
          conv_dtype="bfloat16", ssm_shape=(32, 128, 128), ssm_dtype="float32",
          assumption="GDN conv state bfloat16, recurrent state float32",
          active_params=3e9, attention_width=16 * 256,
          params_source="Qwen3-Next-80B-A3B: 80B parameters, 3B active; 16 query heads × 256"),
)


def by_name(name: str) -> Model:
    for model in MODELS:
        if model.name == name:
            return model
    raise KeyError(name)


@dataclass
class RequestState:
    """One request's state: ``kv[layer] = {"k", "v"}``, ``ssm[layer] = {"conv", "ssm"}``."""

    tokens: int
    kv: dict[int, dict] = field(default_factory=dict)
    ssm: dict[int, dict] = field(default_factory=dict)

    def tensors(self) -> list:
        return [t for group in (*self.kv.values(), *self.ssm.values()) for t in group.values()]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def objects(self) -> int:
        return len(self.kv) + len(self.ssm)


def _random(shape, dtype_name: str, generator):
    import torch

    dtype = getattr(torch, dtype_name)
    bits = {2: torch.int16, 4: torch.int32}[DTYPE_BYTES[dtype_name]]
    return torch.empty(shape, dtype=bits).random_(generator=generator).view(dtype)


def kv_block(model: Model, tokens: int, generator) -> dict:
    shape = (model.kv_heads, tokens, model.head_dim)
    return {"k": _random(shape, model.kv_dtype, generator), "v": _random(shape, model.kv_dtype, generator)}


def ssm_snapshot(model: Model, generator) -> dict:
    return {"conv": _random(model.conv_shape, model.conv_dtype, generator),
            "ssm": _random(model.ssm_shape, model.ssm_dtype, generator)}


def request_state(model: Model, tokens: int, seed: int = 0) -> RequestState:
    import torch

    generator = torch.Generator().manual_seed(seed)
    state = RequestState(tokens)
    for layer in model.attention_layers:
        state.kv[layer] = kv_block(model, tokens, generator)
    for layer in model.ssm_layers:
        state.ssm[layer] = ssm_snapshot(model, generator)
    return state
