"""Torch tensors to payload bytes and back, exactly (dtype, shape and every bit).

- ``torch_dtype(name)`` / ``dtype_name(dtype)`` — wire dtype names (``protocol.dtypes``) ↔ torch.
- ``spec_of(name, tensor)``              — the ``TensorSpec`` a tensor is stored under.
- ``tensor_bytes(tensor)``               — a flat ``uint8`` tensor over the tensor's bytes, on
                                           its own device (contiguous; a copy only when it was not).
- ``tensor_to_spec_and_view(name, t)``   — ``(TensorSpec, memoryview)`` of a CPU copy of the
                                           bytes; zero-copy for a contiguous CPU tensor. The view
                                           keeps the tensor memory alive.
- ``tensor_from_view(spec, view, device=None, copy=True)`` — the tensor back, dtype and shape
                                           restored; ``copy=False`` shares ``view``'s memory.
- ``empty_for(spec, device)`` / ``byte_view(tensor)`` — the building blocks the shared-memory path uses.
- ``can_share(spec, view)``              — whether ``copy=False`` is safe: a writable view whose
                                           address is aligned for the dtype.

Types numpy lacks (bfloat16, float8, bits, sub-byte ints) travel as their raw bytes: every
tensor is reinterpreted as ``uint8`` with ``view`` and never converted. Quantized tensors
are refused: their scale and zero point are not part of a payload (store ``int_repr()``).
"""

from __future__ import annotations

import ctypes
import warnings

import torch

from statetier.protocol.dtypes import TensorSpec, canonical_dtype, itemsize
from statetier.protocol.errors import InvalidRequest

_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})
# integer types of each element size, for copying dtypes that torch cannot copy itself
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire dtype name (aliases and a ``torch.`` prefix accepted)."""
    name = canonical_dtype(name)
    if name in _QUANTIZED:
        raise InvalidRequest(f"quantized dtype {name!r} is not supported: store int_repr() and its parameters")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(f"dtype {name!r} does not exist in torch {torch.__version__}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    torch_dtype(name)  # refuses quantized and unknown types
    return canonical_dtype(name)


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequest(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape))


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``tensor``'s bytes in row-major order, on its own device."""
    t = tensor.detach()
    if not t.is_contiguous():
        try:
            t = t.contiguous()
        except (RuntimeError, NotImplementedError):
            # dtypes without a copy kernel (int1..int7, uint1..uint7): copy their bytes instead
            t = t.view(_SAME_SIZE[t.element_size()]).contiguous()
    return t.reshape(-1).view(torch.uint8)


def tensor_to_spec_and_view(name: str, tensor: torch.Tensor) -> tuple[TensorSpec, memoryview]:
    """The spec of ``tensor`` and a memoryview of its bytes, copied to the CPU if needed."""
    spec = spec_of(name, tensor)
    flat = tensor_bytes(tensor)
    if flat.device.type != "cpu":
        flat = flat.to("cpu")
    return spec, byte_view(flat)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's memory; it keeps the tensor alive."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array._statetier_owner = tensor  # the memory belongs to the tensor: keep it alive
    return memoryview(array).cast("B")


def can_share(spec: TensorSpec, view) -> bool:
    src = memoryview(view)
    if src.readonly or src.nbytes == 0:
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(src))
    return address % max(1, itemsize(spec.dtype)) == 0


def empty_for(spec: TensorSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialised tensor of ``spec``'s dtype and shape."""
    return torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=device or "cpu")


def tensor_from_view(
    spec: TensorSpec,
    view,
    device: torch.device | str | None = None,
    copy: bool = True,
) -> torch.Tensor:
    """Rebuild the tensor that ``view`` holds the bytes of.

    ``copy=False`` returns a CPU tensor over ``view``'s own memory (no copy; the caller
    keeps ``view`` valid and unchanged). Otherwise the bytes are copied into fresh memory
    on ``device`` (default CPU).
    """
    dtype = torch_dtype(spec.dtype)
    src = memoryview(view).cast("B")
    if src.nbytes != spec.nbytes:
        raise InvalidRequest(f"tensor {spec.name!r} has {src.nbytes} bytes; its spec needs {spec.nbytes}")
    target = torch.device(device) if device is not None else torch.device("cpu")
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype, device=target)
    if not copy and target.type == "cpu":
        with warnings.catch_warnings():
            # read-only sources are allowed: the caller promised not to write through them
            warnings.filterwarnings("ignore", message=".*not writable.*")
            flat = torch.frombuffer(src, dtype=torch.uint8)
        return flat.view(dtype).reshape(spec.shape)
    out = empty_for(spec)
    byte_view(tensor_bytes(out))[:] = src
    return out if target.type == "cpu" else out.to(target)
