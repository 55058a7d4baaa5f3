"""The objects the engine tests put: SSM snapshots of a tiny Jamba-like layer.

- ``NS`` — their namespace; ``SPECS`` — conv (3, 256) bf16 + ssm (256, 16) fp32;
  ``TOKENS`` and ``CHAIN``, its prefix hashes in blocks of 16.
- ``payload_for(seed)`` — a payload of ``SPECS``' layout, different per seed.
- ``ssm_put(layer, boundary, …)`` — a ``PutRequest`` of one snapshot at a block boundary and
  its payload.
"""

from __future__ import annotations

from statetier.daemon.requests import PutRequest
from statetier.protocol.dtypes import TensorSpec
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, prefix_hashes
from statetier.protocol.sealed import layout_payload

NS = NamespaceSpec("jamba-tiny", kv_dtype="bfloat16").namespace()
SPECS = (TensorSpec("conv", "bfloat16", (3, 256)), TensorSpec("ssm", "float32", (256, 16)))
TOKENS = list(range(64))
CHAIN = prefix_hashes(TOKENS, 16)


def payload_for(seed: int) -> bytes:
    layout = layout_payload(SPECS)
    return bytes((seed * 31 + i) % 251 for i in range(256)) * (layout.payload_len // 256) + bytes(
        layout.payload_len % 256)


def ssm_put(layer: int = 0, boundary: int = 3, request: str = "req-1", seed: int = 1, version=None,
            tenant: str = "default", ns=NS) -> tuple[PutRequest, bytes]:
    key = StateKey(ns, Kind.SSM, layer, CHAIN[boundary], 0, 16 * (boundary + 1))
    return PutRequest(tenant, key, Provenance(request, step=boundary), SPECS, version=version), payload_for(seed)
