"""How an SGLang HiCache page or Mamba slot maps onto statetier's identity (DESIGN §2).

- ``BackendOptions.from_extra(extra)`` — this backend's part of SGLang's
  ``--hicache-storage-backend-extra-config``; ``url`` and ``weights_revision`` required,
  unknown keys refused.
- ``HiCacheIdentity.build(config, options, kv_pages, mamba_pages)`` — the namespace (model,
  weights revision, KV dtype, pool layouts, page size, TP × CP size), the layer group (PP
  rank) and the shard (TP and CP rank; 0 for MLA KV); ``page_key`` / ``snapshot_key`` name
  the object of a page at a position of the chain.
- ``prefix_bytes(page_hash)`` — SGLang's hex page key as a 32-byte prefix hash.
- ``stream_of(key)`` — the request id a page is stored under (its own hash).

Used by ``backend.py``; imports neither SGLang nor torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from statetier.protocol.errors import InvalidRequest
from statetier.protocol.identity import NamespaceSpec, StateKey

if TYPE_CHECKING:
    from ..sync_client import Client
    from .pages import PoolPages

HASH_ALGORITHM = "sglang-sha256-chain"
#: Keys SGLang itself reads from the extra config; the rest are this backend's options.
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "interface_v2",
                          "allocator", "hicache_storage_pass_prefix_keys", "tp_lcm_size"})
_OPTIONS = frozenset({"url", "tenant", "token", "weights_revision", "publish", "use_shm", "timeout"})


@dataclass(frozen=True)
class BackendOptions:
    """This backend's part of ``--hicache-storage-backend-extra-config``."""

    url: str
    weights_revision: str
    tenant: str = "default"
    token: str | None = None
    publish: bool = False
    use_shm: bool = True
    timeout: float = 10.0

    @classmethod
    def from_extra(cls, extra: dict | None) -> "BackendOptions":
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in _OPTIONS and k not in _SGLANG_KEYS)
        if unknown:
            raise InvalidRequest(f"statetier HiCache backend: unknown extra-config keys {unknown}")
        for required in ("url", "weights_revision"):
            if not extra.get(required):
                raise InvalidRequest(f"statetier HiCache backend: extra-config needs {required!r} "
                                     "(pages of other weights must never be served)")
        return cls(**{k: v for k, v in extra.items() if k in _OPTIONS})


@dataclass(frozen=True)
class HiCacheIdentity:
    """Where an SGLang page or slot sits in statetier's identity (DESIGN §2)."""

    spec: NamespaceSpec
    layer: int  # the pipeline stage's layer group
    shard: int  # TP rank × attention-CP size + CP rank (0 for MLA)
    page_size: int

    @classmethod
    def build(cls, config: Any, options: BackendOptions, kv: PoolPages, mamba: PoolPages | None) -> "HiCacheIdentity":
        cp_size = int(getattr(config, "attn_cp_size", 1) or 1)
        shard = int(config.tp_rank) * cp_size + int(getattr(config, "attn_cp_rank", 0) or 0)
        # MLA KV is whole on every rank: one shard, which one rank writes and all read
        shards = 1 if config.is_mla_model else int(config.tp_size) * cp_size
        if config.is_mla_model and mamba is not None:
            raise InvalidRequest("statetier HiCache backend: an MLA model with a Mamba pool is not supported "
                                 "(its KV is one shard, its Mamba state one per rank)")
        layouts = kv.describe() + ("|" + mamba.describe() if mamba is not None else "")
        spec = NamespaceSpec(
            model_id=str(config.model_name or ""), revision=str(options.weights_revision),
            kv_dtype=str(kv.dtypes[0]).removeprefix("torch."), kv_block_size=kv.page_size,
            ssm_dtype=str(mamba.dtypes[0]).removeprefix("torch.") if mamba else "",
            conv_dtype=str(mamba.dtypes[-1]).removeprefix("torch.") if mamba else "",
            conv_layout=f"sglang:{layouts}:pp{config.pp_size}:cp{cp_size}",
            tp_size=shards, hash_algorithm=HASH_ALGORITHM, tenant=options.tenant)
        return cls(spec, int(config.pp_rank), 0 if config.is_mla_model else shard, kv.page_size)

    def page_key(self, client: Client, page_hash: str, page_index: int) -> StateKey:
        start = page_index * self.page_size
        return client.kv_key(self.layer, prefix_bytes(page_hash), start, start + self.page_size,
                             shard=self.shard)

    def snapshot_key(self, client: Client, page_hash: str, page_index: int) -> StateKey:
        return client.ssm_key(self.layer, prefix_bytes(page_hash), (page_index + 1) * self.page_size,
                              shard=self.shard)


def prefix_bytes(page_hash: str) -> bytes:
    """SGLang's page key (hex SHA-256 of the chain) as statetier's 32-byte prefix hash."""
    try:
        raw = bytes.fromhex(page_hash)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) == 32:
        return raw
    return hashlib.blake2b(str(page_hash).encode("utf-8", "surrogatepass"), digest_size=32).digest()


def stream_of(key: StateKey) -> str:
    """The request id a page is stored under: its own hash. A stream is (namespace, request,
    kind, layer, shard, span), so pages of different prefixes at one span never supersede
    each other, and storing the same page again supersedes the older copy."""
    return key.prefix_hash.hex()
