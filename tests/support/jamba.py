"""Jamba-mini state, as the end-to-end tests put and load it.

- ``jamba_namespace(model)`` — its namespace; ``SSM_LAYERS``, ``ATTENTION_LAYERS``, ``BLOCK``.
- ``snapshot(seed)`` — conv (3, 8192) bf16 + ssm (8192, 16) fp32; ``kv_page(seed, tokens)`` —
  (2, 8, tokens, 128) bf16; ``token_ids(seed, n)``.
- ``assert_same_tensors(got, want)`` — the same names, dtypes, shapes and every bit.
"""

from __future__ import annotations

from typing import Mapping

import torch

from statetier.protocol.identity import NamespaceSpec

SSM_LAYERS = 28
ATTENTION_LAYERS = 4
BLOCK = 64


def jamba_namespace(model: str = "jamba-mini", block: int = BLOCK) -> NamespaceSpec:
    return NamespaceSpec(model_id=model, revision="r1", weight_dtype="bfloat16", kv_block_size=block,
                         kv_dtype="bfloat16", ssm_dtype="float32", conv_dtype="bfloat16", conv_layout="(3,8192)")


def snapshot(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"conv": torch.randn(3, 8192, generator=gen).to(torch.bfloat16),
            "ssm": torch.randn(8192, 16, generator=gen)}


def kv_page(seed: int, tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + seed)
    return {"kv": torch.randn(2, 8, tokens, 128, generator=gen).to(torch.bfloat16)}


def token_ids(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 65_000, (n,), generator=gen).tolist()


def assert_same_tensors(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8) if tensor.dim() else got[name],
                           tensor.view(torch.uint8) if tensor.dim() else tensor), name
