"""SGLang HiCache "L3 storage" backed by statetier: verified KV pages and typed Mamba snapshots.

``HiCacheBackend(storage_config, kwargs=None)`` is the backend's logic; ``storage_class()``
returns it under SGLang's ``HiCacheStorage`` base when SGLang is installed (the package
exports that class as ``StatetierHiCacheStorage``, and says how SGLang is configured to load it).

Calls (SGLang's controller threads; backup and prefetch run at once on one client):

- ``batch_exists(keys, extra_info)`` → pages present counted from the first (one LOOKUP);
- ``batch_set_v1`` / ``batch_get_v1(keys, host_indices, extra_info)`` → ``[bool]``: KV pages
  between the host pool's own slots and the daemon, every load verified (identity, span,
  payload digest) before it counts; a refusal is ``False``, counted by reason, never raised;
- ``batch_exists_v2`` / ``batch_set_v2`` / ``batch_get_v2``: the hybrid path, a Mamba slot
  stored as an SSM snapshot bound to the KV page whose hash keys it;
- ``clear()``, ``get_stats()``; the copying v0 calls (``get``/``set``…) refuse: they carry
  no token positions, and a page without its position cannot be verified.

Identity (``HiCacheIdentity``): model name, weights revision, KV dtype, pool layouts, page
size and TP × CP size form the namespace; the page's chained hash is the prefix hash, its
span comes from ``extra_info.prefix_keys`` (hence ``hicache_storage_pass_prefix_keys``);
the shard folds TP and attention-CP ranks (DP replicas share pages); the layer group is
the PP rank. A lookup answers for every shard, so every rank gives SGLang the same count.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from statetier.protocol.errors import InvalidRequest, StatetierError
from statetier.protocol.identity import StateKey

from ..sync_client import Client
from ..values import PutItem
from .identity import BackendOptions, HiCacheIdentity, prefix_bytes, stream_of
from .pages import PoolPages

log = logging.getLogger("statetier.sglang")

KV, MAMBA = "kv", "mamba"


class HiCacheBackend:
    """The backend's logic; ``StatetierHiCacheStorage`` adds SGLang's base class to it."""

    def __init__(self, storage_config: Any, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.options = BackendOptions.from_extra(getattr(storage_config, "extra_config", None))
        self.registered_pools: dict[str, Any] = {}
        self.mem_pool_host = None
        self.refused: collections.Counter[str] = collections.Counter()
        self.served: collections.Counter[str] = collections.Counter()
        self._client: Client | None = None
        self._identity: HiCacheIdentity | None = None
        self._stored: dict[StateKey, Any] = {}
        self._lock = threading.Lock()

    # -- registration ---------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self.registered_pools[str(host_pool_name)] = host_pool

    def on_host_pools_registered(self) -> None:
        self._connected()

    @property
    def is_writer(self) -> bool:
        config = self.storage_config
        return not config.is_mla_model or int(config.tp_rank) == int(getattr(config, "dcp_rank", 0) or 0)

    # -- KV, v1 ---------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys`` are restorable, counted from the first (one LOOKUP)."""
        chain = _prefix_keys(extra_info)
        if chain is None or not keys:
            self._count_refusal("position_unknown", len(keys))
            return 0
        client, ident = self._connected()
        hashes = chain + list(keys)
        boundaries = [((i + 1) * ident.page_size, prefix_bytes(h)) for i, h in enumerate(hashes)]
        try:
            found = client.lookup([ident.layer], [], boundaries, lease=False)
        except StatetierError as exc:
            self._count_refusal(exc.reason)
            return 0
        return max(0, min(len(keys), found.tokens // ident.page_size - len(chain)))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        return self._move_pages(KV, keys, host_indices, extra_info, self._loads)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not self.is_writer:  # MLA: one rank writes what every rank reads
            return [True] * len(keys)
        return self._move_pages(KV, keys, host_indices, extra_info, self._stores)

    # -- hybrid, v2 -----------------------------------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Sequence[Any] | None = None,
                        extra_info: Any = None):
        """KV pages restorable from the first, cut to endpoints every sidecar pool can restore.

        A Mamba pool (trailing pages, one snapshot) is asked with one joint LOOKUP over the
        KV layer group and the SSM layer group: its answer is the largest endpoint where
        both hold, and only that endpoint is reported restorable (ranks intersect the sets,
        so a shorter answer is safe; a longer one could restore a state that isn't there)."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            name = str(transfer.name)
            if not restorable:
                break
            if name != MAMBA or name not in self.registered_pools:
                self._count_refusal("pool_unsupported")
                restorable = []
                break
            end = self._joint_endpoint(keys[:kv_pages], extra_info)
            restorable = [p for p in restorable if p == end]
            if end:
                hits[name] = end
        final = restorable[-1] if restorable else 0
        return _transfer_result(final, hits, restorable)

    def batch_get_v2(self, transfers: Sequence[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        return {str(t.name): self._move_pages(str(t.name), list(t.keys or []), t.host_indices, extra_info,
                                              self._loads) for t in transfers}

    def batch_set_v2(self, transfers: Sequence[Any], extra_info: Any = None) -> dict[str, list[bool]]:
        results = {}
        for t in transfers:
            name, keys = str(t.name), list(t.keys or [])
            if name == KV and not self.is_writer:
                results[name] = [True] * len(keys)
                continue
            results[name] = self._move_pages(name, keys, t.host_indices, extra_info, self._stores)
        return results

    # -- the copying v0 interface: no positions, so nothing verifiable ----------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        self._count_refusal("position_unknown")
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        self._count_refusal("position_unknown", len(keys))
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        self._count_refusal("position_unknown")
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        self._count_refusal("position_unknown", len(keys))
        return False

    def exists(self, key: str) -> bool:
        return False

    # -- housekeeping ---------------------------------------------------------------------

    def clear(self) -> bool:
        """Delete every object this backend stored (others' stay bound to their own weights)."""
        client, _ = self._connected()
        with self._lock:
            refs, self._stored = list(self._stored.values()), {}
        for ref in refs:
            try:
                client.delete(ref)
            except StatetierError as exc:
                self._count_refusal(exc.reason)
        return True

    def get_stats(self) -> dict:
        return {"served": dict(self.served), "refused": dict(self.refused)}

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- internals ------------------------------------------------------------------------

    def _connected(self) -> tuple[Client, HiCacheIdentity]:
        with self._lock:
            if self._client is None:
                kv_pool = self.registered_pools.get(KV, self.mem_pool_host)
                if kv_pool is None:
                    raise InvalidRequest("statetier HiCache backend: no KV host pool registered")
                mamba_pool = self.registered_pools.get(MAMBA)
                kv = PoolPages.of(kv_pool, KV)
                mamba = PoolPages.of(mamba_pool, MAMBA) if mamba_pool is not None else None
                self._identity = HiCacheIdentity.build(self.storage_config, self.options, kv, mamba)
                o = self.options
                self._client = Client(o.url, namespace=self._identity.spec, tenant=o.tenant, token=o.token,
                                      use_shm=o.use_shm, timeout=o.timeout,
                                      producer_id=f"sglang-{self.storage_config.tp_rank}").connect()
            assert self._identity is not None  # made with the client
            return self._client, self._identity

    def _pages(self, pool_name: str) -> PoolPages:
        pool = self.registered_pools.get(pool_name)
        if pool is None and pool_name == KV:
            pool = self.mem_pool_host
        if pool is None:
            raise InvalidRequest(f"no SGLang host pool named {pool_name!r} is registered")
        return PoolPages.of(pool, MAMBA if pool_name == MAMBA else KV)

    def _key(self, pool_name: str, page_hash: str, page_index: int) -> StateKey:
        client, ident = self._connected()
        if pool_name == MAMBA:
            return ident.snapshot_key(client, page_hash, page_index)
        return ident.page_key(client, page_hash, page_index)

    def _move_pages(self, pool_name: str, keys: list[str], host_indices: Any, extra_info: Any,
                    batch) -> list[bool]:
        """Move the pages of ``keys`` between their slots and the daemon in one batch call.
        A page that cannot move is ``False``, and so are the pages after it (SGLang stops at
        the first missing page); its reason is counted."""
        chain = _prefix_keys(extra_info)
        if chain is None:
            self._count_refusal("position_unknown", len(keys))
            return [False] * len(keys)
        try:
            pages = self._pages(pool_name)
        except InvalidRequest as exc:
            log.warning("statetier HiCache: %s", exc)
            return [False] * len(keys)
        step = pages.page_size
        if host_indices is None or int(host_indices.numel()) != len(keys) * step:
            log.warning("statetier HiCache: %s indices for %d pages of %d slots do not match",
                        pool_name, len(keys), step)
            return [False] * len(keys)
        slots = host_indices.tolist()
        plan = [(int(slots[i * step]), self._key(pool_name, h, len(chain) + i)) for i, h in enumerate(keys)]
        if not plan:
            return []
        moved = batch(pages, plan)
        return [i < moved for i in range(len(plan))]

    def _loads(self, pages: PoolPages, plan: list[tuple[int, StateKey]]) -> int:
        """Load every page into its slot (verified where it lands); how many leading pages did."""
        client, _ = self._connected()
        keys = [key for _, key in plan]
        views = [pages.views(slot) for slot, _ in plan]
        try:
            if views[0] is not None:  # page-first: straight into the pool's own memory
                client.load_many(keys, into=[dict(v) for v in views if v is not None])  # all: one pool
            else:
                loaded = client.load_many(keys, expect=pages.expected(plan[0][0]))
                for (slot, _), tensors in zip(plan, loaded):
                    pages.copy_in(slot, tensors)
            moved = len(plan)
        except StatetierError as exc:
            moved = self._refused_item(exc, pages, plan, "loading")
            if moved:  # the batch's destinations are undefined after a failure: load the good ones again
                moved = self._loads(pages, plan[:moved])
        self.served[pages.kind] += moved
        return moved

    def _stores(self, pages: PoolPages, plan: list[tuple[int, StateKey]]) -> int:
        """Store every page from its slot; how many leading pages were stored."""
        client, _ = self._connected()
        items = [PutItem(key, self._page_tensors(pages, slot), request_id=stream_of(key),
                         publish=self.options.publish) for slot, key in plan]
        try:
            refs = client.put_many(items)
        except StatetierError as exc:
            moved = self._refused_item(exc, pages, plan, "storing")
            return self._stores(pages, plan[:moved]) if moved else 0
        with self._lock:
            self._stored.update(zip((key for _, key in plan), refs))
        return len(plan)

    def _refused_item(self, exc: StatetierError, pages: PoolPages, plan: list, doing: str) -> int:
        """Count a batch's refusal; the number of pages before the refused one."""
        item = exc.detail.get("item")
        index = item if isinstance(item, int) and 0 <= item < len(plan) else 0
        self._count_refusal(exc.reason, detail=f"{doing} {pages.kind} page ending at token "
                                               f"{plan[index][1].token_end}: {exc}")
        return index

    @staticmethod
    def _page_tensors(pages: PoolPages, slot: int) -> list[tuple[str, torch.Tensor]]:
        views = pages.views(slot)
        return views if views is not None else pages.copy_out(slot)

    def _joint_endpoint(self, keys: list[str], extra_info: Any) -> int:
        """The largest page count (relative to ``keys``) where KV and the Mamba snapshot both hold."""
        chain = _prefix_keys(extra_info)
        if chain is None or not keys:
            return 0
        client, ident = self._connected()
        hashes = chain + list(keys)
        boundaries = [((i + 1) * ident.page_size, prefix_bytes(h)) for i, h in enumerate(hashes)]
        try:
            found = client.lookup([ident.layer], [ident.layer], boundaries, lease=False)
        except StatetierError as exc:
            self._count_refusal(exc.reason)
            return 0
        return max(0, found.tokens // ident.page_size - len(chain))

    def _count_refusal(self, reason: str, count: int = 1, *, detail: str = "") -> None:
        if count <= 0:
            return
        self.refused[reason] += count
        if detail:
            log.warning("statetier HiCache refused (%s): %s", reason, detail[:300])


def _prefix_keys(extra_info: Any) -> list[str] | None:
    keys = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
    return list(keys) if keys is not None else None


@dataclass
class TransferResult:
    """``PoolTransferResult``'s fields, for use without SGLang."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict
    restorable_prefix_pages: list | None = None


def _transfer_result(final: int, hits: dict, restorable: list):
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
    except ImportError:
        return TransferResult(final, hits, restorable)
    return PoolTransferResult(final, hits, restorable)


def storage_class() -> type:
    """``HiCacheBackend`` with SGLang's ``HiCacheStorage`` base, or alone without SGLang."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    except ImportError:
        return HiCacheBackend

    class StatetierHiCacheStorage(HiCacheBackend, HiCacheStorage):
        """statetier as SGLang's HiCache L3 storage (see the module docstring)."""

    StatetierHiCacheStorage.__module__ = __package__  # found by SGLang and pickle under the public path
    return StatetierHiCacheStorage
