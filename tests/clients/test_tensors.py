"""Tensors to payload bytes and back: every dtype torch has, every shape, bit for bit."""

from __future__ import annotations

import pytest
import torch

from statetier.protocol.dtypes import DTYPES, TensorSpec
from statetier.protocol.errors import InvalidRequest
from statetier.clients.tensors import (
    byte_view,
    can_share,
    dtype_name,
    tensor_bytes,
    tensor_from_view,
    tensor_to_spec_and_view,
    torch_dtype,
)

QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
STORABLE = sorted(name for name in DTYPES if name not in QUANTIZED and isinstance(getattr(torch, name, None), torch.dtype))
SHAPES = [(), (0,), (3, 0, 2), (1,), (5,), (2, 3), (4, 1, 3), (2, 8, 5, 16)]
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns of ``dtype`` (NaNs included): built from random bytes."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    high = 2 if dtype is torch.bool else 256  # other bytes are not valid bools: torch copies normalise them
    raw = torch.randint(0, high, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(byte_view(tensor_bytes(t)))


def assert_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert got.device == want.device
    assert raw_bytes(got) == raw_bytes(want)


def test_every_wire_dtype_name_maps_to_torch_and_back() -> None:
    for name in STORABLE:
        assert dtype_name(torch_dtype(name)) == name
    assert torch_dtype("torch.half") is torch.float16
    assert dtype_name(torch.float) == "float32"


@pytest.mark.parametrize("name", STORABLE)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_is_exact_for_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    original = random_tensor(torch_dtype(name), shape, seed=len(shape))
    spec, view = tensor_to_spec_and_view("t", original)
    assert spec == TensorSpec("t", name, shape)
    assert view.nbytes == spec.nbytes == original.numel() * original.element_size()

    copied = tensor_from_view(spec, view)
    assert_identical(copied, original)
    shared = tensor_from_view(spec, bytes(view), copy=False)
    assert_identical(shared, original)


@pytest.mark.parametrize("name", STORABLE)
def test_non_contiguous_input_is_stored_in_row_major_order(name: str) -> None:
    base = random_tensor(torch_dtype(name), (6, 8), seed=7)
    strided = base[1::2, ::3]  # non-contiguous in both dims
    transposed = base.t()
    for source in (strided, transposed):
        assert not source.is_contiguous()
        spec, view = tensor_to_spec_and_view("x", source)
        assert spec.shape == tuple(source.shape)
        restored = tensor_from_view(spec, view)
        assert restored.is_contiguous()
        # element by element: compare through a same-size integer view (NaN-proof)
        same = _SAME_SIZE.get(source.element_size())
        if same is None:  # complex128: torch copies it bit for bit
            assert raw_bytes(restored) == raw_bytes(source.contiguous())
        else:
            assert torch.equal(restored.view(same), source.view(same).contiguous())


def test_zero_copy_view_of_a_contiguous_cpu_tensor_shares_memory() -> None:
    t = torch.arange(16, dtype=torch.float32)
    _, view = tensor_to_spec_and_view("x", t)
    t[3] = 99.0
    assert torch.frombuffer(bytearray(view), dtype=torch.float32)[3].item() == 99.0


def test_view_keeps_the_tensor_memory_alive() -> None:
    _, view = tensor_to_spec_and_view("x", torch.full((1024,), 7, dtype=torch.int64))
    garbage = [torch.zeros(1024, dtype=torch.int64) for _ in range(64)]  # reuse freed memory, if any
    assert torch.frombuffer(bytearray(view), dtype=torch.int64).eq(7).all()
    del garbage


def test_copy_false_shares_the_source_buffer_and_copy_true_does_not() -> None:
    original = torch.arange(8, dtype=torch.int32)
    spec, view = tensor_to_spec_and_view("x", original)
    buffer = bytearray(view)
    shared = tensor_from_view(spec, buffer, copy=False)
    copied = tensor_from_view(spec, buffer)
    buffer[0] = 42
    assert shared[0].item() == 42
    assert copied[0].item() == 0


def test_bfloat16_and_float8_keep_their_bits() -> None:
    bf = torch.tensor([1.5, -0.0, float("inf"), float("nan")], dtype=torch.bfloat16)
    spec, view = tensor_to_spec_and_view("bf", bf)
    assert spec.dtype == "bfloat16" and view.nbytes == 8
    assert_identical(tensor_from_view(spec, view), bf)
    f8 = torch.tensor([0.5, -2.0, 448.0], dtype=torch.float32).to(torch.float8_e4m3fn)
    spec, view = tensor_to_spec_and_view("f8", f8)
    assert_identical(tensor_from_view(spec, view), f8)


def test_scalar_and_zero_size_tensors() -> None:
    scalar = torch.tensor(3.25, dtype=torch.float64)
    spec, view = tensor_to_spec_and_view("s", scalar)
    assert spec.shape == () and view.nbytes == 8
    restored = tensor_from_view(spec, view)
    assert restored.dim() == 0 and restored.item() == 3.25

    empty = torch.empty((4, 0, 2), dtype=torch.bfloat16)
    spec, view = tensor_to_spec_and_view("e", empty)
    assert spec.shape == (4, 0, 2) and view.nbytes == 0
    assert_identical(tensor_from_view(spec, b""), empty)


def test_tensor_with_autograd_history_is_stored_detached() -> None:
    t = torch.ones(3, requires_grad=True) * 2
    spec, view = tensor_to_spec_and_view("g", t)
    restored = tensor_from_view(spec, view)
    assert not restored.requires_grad and restored.tolist() == [2.0, 2.0, 2.0]


def test_wrong_byte_count_is_refused() -> None:
    spec = TensorSpec("x", "float32", (4,))
    with pytest.raises(InvalidRequest, match="16"):
        tensor_from_view(spec, bytes(15))


def test_quantized_tensors_are_refused_with_a_reason() -> None:
    q = torch.quantize_per_tensor(torch.ones(4), scale=0.5, zero_point=0, dtype=torch.qint8)
    with pytest.raises(InvalidRequest, match="int_repr"):
        tensor_to_spec_and_view("q", q)
    with pytest.raises(InvalidRequest, match="quantized"):
        tensor_from_view(TensorSpec("q", "qint8", (4,)), bytes(4))


def test_non_tensor_input_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="not a torch.Tensor"):
        tensor_to_spec_and_view("x", [1, 2, 3])


def test_can_share_requires_a_writable_aligned_view() -> None:
    spec = TensorSpec("x", "float32", (4,))
    aligned = memoryview(byte_view(torch.zeros(8, dtype=torch.float32)))
    assert can_share(spec, aligned[:16])
    assert not can_share(spec, aligned[1:17])
    assert not can_share(spec, bytes(16))
    assert can_share(TensorSpec("b", "uint8", (16,)), aligned[1:17])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_round_trip_through_cpu_bytes() -> None:
    original = random_tensor(torch.bfloat16, (2, 8, 5, 128), seed=1).to("cuda")
    spec, view = tensor_to_spec_and_view("kv", original[:, :, 1:4])
    restored = tensor_from_view(spec, view, device="cuda")
    assert restored.device.type == "cuda"
    assert torch.equal(restored, original[:, :, 1:4])
