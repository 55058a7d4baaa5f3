"""Pages of SGLang's host pools as named torch tensors: what the HiCache backend moves.

SGLang (``sglang.srt.mem_cache.pool_host``) keeps HiCache's host tier in pools; a storage
backend is handed a pool and the slot indices of the pages to move. This module turns a
pool slot into the tensors of one statetier object, without importing SGLang:

- ``PoolPages.of(pool, kind)``   — the adapter for one registered pool; ``kind`` is
                                   ``"kv"`` (K and V of every layer of one page) or
                                   ``"mamba"`` (temporal state, then each conv state).
- ``pages.views(slot)``          — ``[(name, tensor)]`` over the pool's own memory (page-first
                                   layouts: zero copy, from ``get_page_buffer_meta``) or
                                   ``None`` when the layout has no contiguous page.
- ``pages.copy_out(slot)`` / ``pages.copy_in(slot, tensors)`` — the copying form for other
                                   layouts (``get_data_page`` / ``set_from_flat_data_page``).
- ``pages.describe()``           — the layout facts folded into the namespace.

Names are stable per pool: ``k``, ``v`` for KV; ``temporal`` (absent for conv-only models)
and ``conv0`` … ``convN`` for Mamba, in the order ``get_page_buffer_meta`` gives pointers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from statetier.protocol.errors import InvalidRequest

ZERO_COPY_LAYOUTS = ("page_first", "page_first_direct")


def tensor_at(address: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D ``dtype`` tensor over ``nbytes`` of host memory at ``address`` (no copy).

    The memory belongs to the pool, which SGLang keeps alive while it is registered."""
    if nbytes <= 0 or nbytes % dtype.itemsize:
        raise InvalidRequest(f"a page region of {nbytes} bytes does not hold whole {dtype} elements")
    raw = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype)


@dataclass(frozen=True)
class PoolPages:
    """One host pool seen as pages of named tensors."""

    pool: Any
    kind: str
    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, pool: Any, kind: str) -> "PoolPages":
        if kind == "kv":
            dtype = pool.dtype
            return cls(pool, kind, ("k", "v"), (dtype, dtype))
        if kind == "mamba":
            convs = len(pool.conv_buffer)
            names = tuple(f"conv{i}" for i in range(convs))
            dtypes = (pool.conv_dtype,) * convs
            if getattr(pool, "temporal_state_elem_size", 1) > 0:
                names, dtypes = ("temporal",) + names, (pool.temporal_dtype,) + dtypes
            return cls(pool, kind, names, dtypes)
        raise InvalidRequest(f"unknown SGLang pool kind {kind!r}")

    @property
    def page_size(self) -> int:
        return int(getattr(self.pool, "page_size", 1) or 1)

    @property
    def is_zero_copy(self) -> bool:
        return getattr(self.pool, "layout", "") in ZERO_COPY_LAYOUTS

    def describe(self) -> str:
        """Layout facts that decide whether two pools' pages are interchangeable."""
        pool = self.pool
        parts = [self.kind, str(getattr(pool, "layout", "")), f"page={self.page_size}"]
        if self.kind == "kv":
            parts += [f"layers={pool.layer_num}", f"heads={pool.head_num}", f"dim={pool.head_dim}"]
        else:
            parts += [f"layers={getattr(pool, 'num_mamba_layers', '')}",
                      f"temporal={tuple(getattr(pool, 'temporal_state_shape', ()))}",
                      f"conv={[tuple(s) for s in getattr(pool, 'conv_state_shapes', ())]}"]
        return ";".join(parts)

    def views(self, slot: int) -> list[tuple[str, torch.Tensor]] | None:
        """The page starting at ``slot`` as tensors over the pool's memory, or None."""
        if not self.is_zero_copy:
            return None
        indices = torch.arange(slot, slot + self.page_size, dtype=torch.int64)
        pointers, sizes = self.pool.get_page_buffer_meta(indices)
        if len(pointers) != len(self.names):
            raise InvalidRequest(f"the {self.kind} pool gave {len(pointers)} regions for one page, "
                                 f"expected {len(self.names)}")
        return [(name, tensor_at(int(ptr), int(size), dtype))
                for name, dtype, ptr, size in zip(self.names, self.dtypes, pointers, sizes)]

    def copy_out(self, slot: int) -> list[tuple[str, torch.Tensor]]:
        """The page at ``slot`` as one flat tensor (layouts without contiguous pages)."""
        return [("page", self.pool.get_data_page(slot, flat=True).contiguous())]

    def copy_in(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        self.pool.set_from_flat_data_page(slot, tensors["page"])

    def expected(self, slot: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """What a load into ``slot`` must find: the names, dtypes and shapes of the page."""
        views = self.views(slot)
        if views is None:
            dummy = self.pool.get_dummy_flat_data_page()
            return {"page": (dummy.dtype, tuple(dummy.shape))}
        return {name: (tensor.dtype, tuple(tensor.shape)) for name, tensor in views}
