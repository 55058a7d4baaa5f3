"""Tiny random-weight hybrid models from transformers config classes (no downloads).

- ``ARCHITECTURES`` — name → ``Arch`` (display name, config and model class names, tiny
  config kwargs) for the 13 families the PD demo covers: Jamba, Bamba, Zamba, Zamba2,
  Falcon-H1, GraniteMoeHybrid, Nemotron-H, Qwen3-Next, OlmoHybrid, Kimi-Linear, LFM2,
  Mamba2, Mamba.
- ``build_model(name, seed=0)`` — the model in eval mode; the same seed gives the same
  weights in every process. ``UnavailableArch`` when this transformers lacks the family.
- ``prompt(seed, length)`` — token ids in ``[3, VOCAB)`` (0–2 are pad/bos/eos).
- ``prefill(model, token_ids)`` → ``(cache, first_token)``; ``greedy_decode(model, cache,
  first_token, position, count)`` → ``count`` tokens starting with ``first_token``;
  ``reference_tokens(model, token_ids, count)`` — both in one process, no statetier.

``initializer_range=0.5`` makes the outputs depend visibly on every layer's state (the
default 0.02 leaves several of these tiny models printing one token forever).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from statetier.clients.transformers import forward_from, new_cache

VOCAB = 97
INIT_RANGE = 0.5
_IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=INIT_RANGE)
_BASE = dict(_IDS, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
_MAMBA2_MIXER = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
                     mamba_expand=2, mamba_chunk_size=8)
_ALTERNATING = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def _cfg(*bases: dict, **kwargs) -> dict:
    """Later entries win, so a family may override the shared defaults."""
    merged: dict = {}
    for base in bases:
        merged.update(base)
    return {**merged, **kwargs}


class UnavailableArch(RuntimeError):
    """The installed transformers cannot build this family."""


@dataclass(frozen=True)
class Arch:
    display: str
    config_class: str
    model_class: str
    kwargs: dict = field(default_factory=dict)


ARCHITECTURES: dict[str, Arch] = {
    "jamba": Arch("Jamba", "JambaConfig", "JambaForCausalLM", _cfg(
        _BASE, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4)),
    "bamba": Arch("Bamba", "BambaConfig", "BambaForCausalLM", _cfg(
        _BASE, _MAMBA2_MIXER, num_hidden_layers=4, attn_layer_indices=[1, 3])),
    "zamba": Arch("Zamba", "ZambaConfig", "ZambaForCausalLM", _cfg(
        _BASE, num_hidden_layers=6, attention_hidden_size=64, attention_head_dim=16, num_key_value_heads=4,
        n_mamba_heads=2, attn_layer_period=3, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4)),
    "zamba2": Arch("Zamba2", "Zamba2Config", "Zamba2ForCausalLM", _cfg(
        _BASE, num_hidden_layers=6, num_key_value_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_ngroups=1, n_mamba_heads=4, chunk_size=8, adapter_rank=4, num_mem_blocks=1, use_mem_rope=True,
        layers_block_type=["linear_attention", "linear_attention", "hybrid"] * 2)),
    "falcon_h1": Arch("Falcon-H1", "FalconH1Config", "FalconH1ForCausalLM", _cfg(
        _BASE, _MAMBA2_MIXER, num_hidden_layers=3, head_dim=8, mamba_d_ssm=64)),
    "granitemoehybrid": Arch("GraniteMoeHybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", _cfg(
        _BASE, _MAMBA2_MIXER, num_hidden_layers=4, layer_types=_ALTERNATING, num_local_experts=2,
        num_experts_per_tok=1, shared_intermediate_size=32)),
    "nemotron_h": Arch("Nemotron-H", "NemotronHConfig", "NemotronHForCausalLM", _cfg(
        _BASE, layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"], head_dim=8,
        ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, conv_kernel=4, chunk_size=8, expand=2)),
    "qwen3_next": Arch("Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM", _cfg(
        _BASE, num_hidden_layers=4, layer_types=_ALTERNATING, head_dim=8, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
    "olmo_hybrid": Arch("OlmoHybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM", _cfg(
        _BASE, num_hidden_layers=4, layer_types=_ALTERNATING, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4)),
    "kimi_linear": Arch("Kimi-Linear", "KimiLinearConfig", "KimiLinearForCausalLM", _cfg(
        _BASE, num_hidden_layers=4, layer_types=_ALTERNATING, mlp_layer_types=["dense", "sparse"] * 2,
        moe_intermediate_size=16, num_experts=4, num_experts_per_token=2, kv_lora_rank=8, qk_rope_head_dim=4,
        v_head_dim=8, qk_nope_head_dim=8, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
        head_dim=8, num_key_value_heads=4)),
    "lfm2": Arch("LFM2", "Lfm2Config", "Lfm2ForCausalLM", _cfg(
        _BASE, num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, conv_L_cache=3,
        block_auto_adjust_ff_dim=False)),
    "mamba2": Arch("Mamba2", "Mamba2Config", "Mamba2ForCausalLM", _cfg(
        _IDS, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1,
        conv_kernel=4, expand=2, chunk_size=8, time_step_rank=4)),
    "mamba": Arch("Mamba", "MambaConfig", "MambaForCausalLM", _cfg(
        _IDS, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4, expand=2, time_step_rank=4,
        intermediate_size=64)),
}


def build_model(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """The tiny ``name`` model with weights drawn under ``torch.manual_seed(seed)``."""
    import transformers

    arch = ARCHITECTURES[name]
    config_class = getattr(transformers, arch.config_class, None)
    model_class = getattr(transformers, arch.model_class, None)
    if config_class is None or model_class is None:
        raise UnavailableArch(f"transformers {transformers.__version__} has no {arch.model_class}")
    config = config_class(**{**arch.kwargs, **overrides})
    torch.manual_seed(seed)
    return model_class(config).eval()


def prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


def prefill(model, token_ids: Sequence[int]):
    """A fresh cache that absorbed ``token_ids``, and the greedy token after them."""
    cache = new_cache(model.config)
    logits = forward_from(model, cache, list(token_ids), 0)
    return cache, int(logits.argmax())


def greedy_decode(model, cache, first_token: int, position: int, count: int) -> list[int]:
    """``count`` greedy tokens: ``first_token``, then each argmax after feeding the previous one."""
    tokens = [first_token]
    for i in range(count - 1):
        tokens.append(int(forward_from(model, cache, [tokens[-1]], position + i).argmax()))
    return tokens


def reference_tokens(model, token_ids: Sequence[int], count: int) -> list[int]:
    """Single-process generation: prefill and decode on one cache, nothing saved or restored."""
    cache, first = prefill(model, token_ids)
    return greedy_decode(model, cache, first, len(token_ids), count)
