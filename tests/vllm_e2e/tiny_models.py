"""The tiny random-weight models of the vLLM end-to-end runs: ``statetier.clients.vllm.tiny_models``
(also ``python -m statetier.clients.vllm.tiny_models``, what docs/integration.md's recipe runs on)."""

from statetier.clients.vllm.tiny_models import VOCAB, write_granite_hybrid, write_llama

__all__ = ["VOCAB", "write_granite_hybrid", "write_llama"]
