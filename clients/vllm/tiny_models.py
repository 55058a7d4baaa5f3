"""Tiny random-weight models that vLLM (CPU) can serve, written to a folder: what
docs/integration.md's vLLM recipe and ``make test-vllm`` run on. Nothing is downloaded.

``python -m statetier.clients.vllm.tiny_models --out DIR [--model granite-hybrid|llama]``
writes one (``config.json``, ``model.safetensors``) and prints the vLLM flags it needs.

- ``write_llama(path)``  — attention only: 2 layers, 4 heads (2 KV heads), head_dim 32.
- ``write_granite_hybrid(path)`` — GraniteMoeHybrid without experts: Mamba2, attention,
  Mamba2, attention (head_dim 32; Mamba2 8 heads of 32, state 16).

No tokenizer: the engines run with ``skip_tokenizer_init=True`` (``--skip-tokenizer-init``)
and token-id prompts. Weights are float32 with ``initializer_range`` large enough that every
layer's state changes the greedy tokens. The seed makes the weights identical in every
process. Needs torch and transformers (vLLM's environment has both); built from their
configs alone, offline (``HF_HUB_OFFLINE=1`` is set for the command).
"""

from __future__ import annotations

import argparse
import json
import os
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


MODELS = {"granite-hybrid": write_granite_hybrid, "llama": write_llama}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m statetier.clients.vllm.tiny_models",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="DIR", type=Path, required=True, help="the folder to write the model into")
    parser.add_argument("--model", choices=sorted(MODELS), default="granite-hybrid",
                        help="granite-hybrid (Mamba2 + attention, default) or llama (attention only)")
    parser.add_argument("--seed", type=int, default=13, help="the weights' seed (default: %(default)s)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: nothing to fetch
    path = MODELS[args.model](args.out, seed=args.seed)
    print(f"wrote a tiny {args.model} model to {path}; serve it with vLLM's --model {path} --skip-tokenizer-init "
          f"--dtype float32 (prompts as token ids below {VOCAB})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
