"""Tiny random-weight models that vLLM (CPU) can serve, written to a folder.

- ``write_llama(path)``  — attention only: 2 layers, 4 heads (2 KV heads), head_dim 32.
- ``write_granite_hybrid(path)`` — GraniteMoeHybrid without experts: Mamba2, attention,
  Mamba2, attention (head_dim 32; Mamba2 8 heads of 32, state 16).

No tokenizer: the engines run with ``skip_tokenizer_init=True`` and token-id prompts.
Weights are float32 with ``initializer_range`` large enough that every layer's state
changes the greedy tokens. The seed makes the weights identical in every process.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512


def _save(model, path: Path) -> Path:
    from transformers.utils import logging

    logging.disable_progress_bar()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_llama(path: Path, *, seed: int = 13) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         tie_word_embeddings=False)
    return _save(LlamaForCausalLM(config).to(torch.float32), path)


def write_granite_hybrid(path: Path, *, seed: int = 13) -> Path:
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, shared_intermediate_size=256,
        num_local_experts=0, num_experts_per_tok=0, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"], num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, position_embedding_type="rope", initializer_range=0.2,
        mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=128, bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    return _save(GraniteMoeHybridForCausalLM(config).to(torch.float32), path)
