"""Stand-ins for SGLang's host pools (``sglang.srt.mem_cache.pool_host``), which need a GPU
stack to import: the same buffers, layouts and ``get_page_buffer_meta`` pointer arithmetic
as ``MHATokenToKVPoolHost`` and ``MambaPoolHost`` in sglang 0.5.23, page-first layout; and
the fields of SGLang's config, extra-info and transfer values the backend reads, plus
``chain(seed, pages)``, SGLang's page keys; ``PAGE`` tokens a page, ``slots(first, pages)``
the token slots of ``pages`` pages. Used by the tests and ``benchmarks/workload_sglang``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass
class StorageConfig:
    """``HiCacheStorageConfig``'s fields (sglang 0.5.23) that the backend reads."""

    extra_config: dict
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    model_name: str = "ibm-granite/granite-4.0-h-tiny"
    dp_rank: int = 0


@dataclass
class ExtraInfo:
    prefix_keys: list | None = None


@dataclass
class Transfer:
    """``PoolTransfer``'s fields the backend reads."""

    name: str
    keys: list
    host_indices: torch.Tensor | None = None
    hit_policy: str = "trailing_pages"
    extra: dict = field(default_factory=dict)


def chain(seed: int, pages: int) -> list[str]:
    """SGLang's page keys: a SHA-256 chain over each page's token ids, hex."""
    keys, previous = [], b""
    for page in range(pages):
        tokens = bytes(f"{seed}:{page}", "ascii")
        previous = hashlib.sha256(previous + tokens).digest()
        keys.append(previous.hex())
    return keys


class KVPoolHost:
    """Page-first MHA pool: ``kv_buffer[2, size, layer_num, head_num, head_dim]``."""

    layout = "page_first"

    def __init__(self, size: int = 256, page_size: int = 16, layer_num: int = 4, head_num: int = 2,
                 head_dim: int = 32, dtype: torch.dtype = torch.bfloat16) -> None:
        self.size, self.page_size, self.layer_num = size, page_size, layer_num
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        self.kv_buffer = torch.zeros((2, size, layer_num, head_num, head_dim), dtype=dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor):
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        pointers = []
        for index in indices.tolist()[:: self.page_size]:
            k_ptr = base + index * self.layer_num * self.head_num * self.head_dim * item
            pointers += [k_ptr, k_ptr + v_offset]
        element = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return pointers, [element] * len(pointers)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index: index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index: index + self.page_size] = data_page.reshape(
            2, self.page_size, self.layer_num, self.head_num, self.head_dim)

    def fill_page(self, slot: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        page = torch.randn(self.kv_buffer[:, slot: slot + self.page_size].shape, generator=generator)
        self.kv_buffer[:, slot: slot + self.page_size] = page.to(self.dtype)

    def page(self, slot: int) -> torch.Tensor:
        return self.kv_buffer[:, slot: slot + self.page_size].clone()


class LayerFirstKVPoolHost(KVPoolHost):
    """Layer-first MHA pool: pages are not contiguous, so only the copying path serves it."""

    layout = "layer_first"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kv_buffer = torch.zeros((2, self.layer_num, self.size, self.head_num, self.head_dim),
                                     dtype=self.dtype)

    def get_page_buffer_meta(self, indices):  # pragma: no cover - not called for this layout
        raise AssertionError("layer-first pages have no single pointer")

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index: index + self.page_size]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index: index + self.page_size] = data_page.reshape(
            2, self.layer_num, self.page_size, self.head_num, self.head_dim)

    def fill_page(self, slot: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        page = torch.randn(self.kv_buffer[:, :, slot: slot + self.page_size].shape, generator=generator)
        self.kv_buffer[:, :, slot: slot + self.page_size] = page.to(self.dtype)

    def page(self, slot: int) -> torch.Tensor:
        return self.kv_buffer[:, :, slot: slot + self.page_size].clone()


class MambaPoolHost:
    """Page-first Mamba pool: one slot holds every Mamba layer's temporal and conv states."""

    layout = "page_first"
    page_size = 1

    def __init__(self, size: int = 16, num_mamba_layers: int = 3, temporal_shape=(4, 8, 16),
                 conv_shapes=((64, 3),), temporal_dtype=torch.float32, conv_dtype=torch.bfloat16) -> None:
        self.size, self.num_mamba_layers = size, num_mamba_layers
        self.temporal_state_shape = tuple(temporal_shape)
        self.conv_state_shapes = [tuple(s) for s in conv_shapes]
        self.temporal_dtype, self.conv_dtype = temporal_dtype, conv_dtype
        self.temporal_state_elem_size = int(torch.Size(self.temporal_state_shape).numel())
        self.conv_state_elem_sizes = [int(torch.Size(s).numel()) for s in self.conv_state_shapes]
        self.temporal_buffer = torch.zeros((size, num_mamba_layers, 1) + self.temporal_state_shape,
                                           dtype=temporal_dtype)
        self.conv_buffer = [torch.zeros((size, num_mamba_layers, 1) + s, dtype=conv_dtype)
                            for s in self.conv_state_shapes]

    def get_page_buffer_meta(self, indices: torch.Tensor):
        pointers, sizes = [], []
        for index in indices.tolist():
            item = self.temporal_dtype.itemsize
            pointers.append(self.temporal_buffer.data_ptr()
                            + index * self.num_mamba_layers * self.temporal_state_elem_size * item)
            sizes.append(self.num_mamba_layers * self.temporal_state_elem_size * item)
            for buf, elems in zip(self.conv_buffer, self.conv_state_elem_sizes):
                pointers.append(buf.data_ptr() + index * self.num_mamba_layers * elems * self.conv_dtype.itemsize)
                sizes.append(self.num_mamba_layers * elems * self.conv_dtype.itemsize)
        return pointers, sizes

    def fill_slot(self, slot: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.temporal_buffer[slot] = torch.randn(self.temporal_buffer[slot].shape, generator=generator)
        for buf in self.conv_buffer:
            buf[slot] = torch.randn(buf[slot].shape, generator=generator).to(self.conv_dtype)

    def slot(self, slot: int) -> list[torch.Tensor]:
        return [self.temporal_buffer[slot].clone()] + [buf[slot].clone() for buf in self.conv_buffer]


PAGE = 16


def slots(first_slot: int, pages: int, page_size: int = PAGE) -> torch.Tensor:
    return torch.arange(first_slot, first_slot + pages * page_size, dtype=torch.int64)
