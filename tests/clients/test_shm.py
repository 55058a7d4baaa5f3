"""The client's mapping of a host arena: a real shared file, written and read through mmap."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from statetier.clients.shm import HostArena
from statetier.clients.tensors import spec_of, tensor_bytes
from statetier.protocol.errors import InvalidRequest, Unavailable
from statetier.protocol.sealed import layout_payload

ARENA_BYTES = 1 << 20


@pytest.fixture
def arena_file(tmp_path: Path) -> Path:
    path = tmp_path / "arena"
    with open(path, "wb") as handle:
        handle.truncate(ARENA_BYTES)
    return path


def tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(3, 8192, generator=gen)[:, :100].to(torch.bfloat16),  # non-contiguous source
            torch.tensor(7, dtype=torch.int64), torch.empty(0, 4), torch.randn(16, 16, generator=gen)]


def test_tensors_written_at_offsets_are_read_back_exactly_and_seen_by_another_mapping(arena_file: Path) -> None:
    arena = HostArena.open(str(arena_file), ARENA_BYTES)
    try:
        originals = tensors()
        layout = layout_payload([spec_of(f"t{i}", t) for i, t in enumerate(originals)])
        arena.write_tensors(4096, list(zip(originals, layout.offsets)))

        # the daemon's side: an independent mapping of the same file sees the bytes in place
        with open(arena_file, "r+b") as handle, mmap.mmap(handle.fileno(), ARENA_BYTES) as other:
            for t, offset in zip(originals, layout.offsets):
                start = 4096 + offset
                assert other[start : start + t.numel() * t.element_size()] == bytes(
                    tensor_bytes(t).tolist())

        restored = arena.read_tensors(4096, list(zip(layout.specs, layout.offsets)))
        for got, want in zip(restored, originals):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(tensor_bytes(got), tensor_bytes(want))
    finally:
        arena.close()


def test_regions_outside_the_arena_are_refused(arena_file: Path) -> None:
    arena = HostArena.open(str(arena_file), ARENA_BYTES)
    try:
        with pytest.raises(InvalidRequest, match="outside"):
            arena.region(ARENA_BYTES - 8, 16)
        with pytest.raises(InvalidRequest):
            arena.write_tensors(ARENA_BYTES - 8, [(torch.zeros(4, dtype=torch.float32), 0)])
    finally:
        arena.close()


def test_close_with_a_tensor_still_sharing_the_mapping_is_deferred(arena_file: Path) -> None:
    arena = HostArena.open(str(arena_file), ARENA_BYTES)
    region = arena.region(0, 64)
    arena.close()  # does not raise; the mapping lives until ``region`` is freed
    region.fill_(1)
    del region


def test_missing_or_short_arena_file_is_unavailable(tmp_path: Path, arena_file: Path) -> None:
    with pytest.raises(Unavailable, match="cannot open"):
        HostArena.open(str(tmp_path / "absent"), ARENA_BYTES)
    with pytest.raises(Unavailable, match="smaller"):
        HostArena.open(str(arena_file), ARENA_BYTES * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_go_straight_to_and_from_the_arena(arena_file: Path) -> None:
    arena = HostArena.open(str(arena_file), ARENA_BYTES)
    try:
        on_gpu = [t.to("cuda") for t in tensors()]
        layout = layout_payload([spec_of(f"t{i}", t) for i, t in enumerate(on_gpu)])
        arena.write_tensors(0, list(zip(on_gpu, layout.offsets)))
        restored = arena.read_tensors(0, list(zip(layout.specs, layout.offsets)), device="cuda")
        for got, want in zip(restored, on_gpu):
            assert got.device.type == "cuda"
            assert torch.equal(tensor_bytes(got).cpu(), tensor_bytes(want).cpu())
    finally:
        arena.close()

