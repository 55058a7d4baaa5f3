"""Every dtype the installed torch can build a tensor of has a wire code and round-trips exactly.

The dtypes are discovered from the installed torch (every ``torch.dtype`` attribute), so a
torch upgrade that adds a type fails ``test_the_table_covers_every_torch_dtype`` until the
table in ``protocol/dtypes.py`` gets a new, never reused code for it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from statetier.protocol import dtypes
from statetier.protocol.dtypes import TensorSpec, canonical_dtype, dtype_code, dtype_name, itemsize
from statetier.protocol.errors import InvalidRequest, MalformedState
from statetier.protocol.identity import Kind, NamespaceSpec, Provenance, StateKey, StateRef
from statetier.protocol.keyring import dev_keyring
from statetier.protocol.sealed import DigestAlg, Expectation, open_sealed, seal_object

KEYRING = dev_keyring()
NS = NamespaceSpec("org/dtypes").namespace()
KEY = StateKey(NS, Kind.SSM, 1, bytes(32), 0, 8)

DTYPE_ATTRS = {name: value for name in dir(torch) if isinstance(value := getattr(torch, name), torch.dtype)}


def _buildable(dtype: torch.dtype) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.empty((2,), dtype=dtype)
        except (RuntimeError, TypeError, NotImplementedError):
            return False
    return True


TORCH_DTYPES = sorted({d for d in DTYPE_ATTRS.values() if _buildable(d)}, key=str)


# torch stores these packed per row (a (4, 5) quint4x2 tensor has 12 storage bytes) while
# reporting element_size() == 1 and nbytes == numel: torch itself has no flat byte image of
# them that matches its own nbytes, so only the table entry and the element size are checked.
PACKED_QUANTIZED = {torch.quint4x2, torch.quint2x4}
ROUND_TRIP_DTYPES = [d for d in TORCH_DTYPES if d not in PACKED_QUANTIZED]


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor sharing the tensor's bytes: a ``view(torch.uint8)`` where torch
    allows it, the raw storage for quantized tensors (whose uint8 view is still quantized)."""
    if tensor.is_quantized:
        raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
        assert raw.numel() == tensor.numel() * tensor.element_size()
        return raw
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return tensor.reshape(-1).view(torch.uint8)


def raw_bytes(tensor: torch.Tensor) -> bytearray:
    """The tensor's bytes, copied into a bytearray (no numpy here)."""
    flat = _byte_view(tensor)
    out = bytearray(flat.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(flat)
    return out


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensor = torch.empty(shape, dtype=dtype)  # zeros() has no fill kernel for sub-byte types
    flat = _byte_view(tensor)
    if flat.numel():
        gen = torch.Generator().manual_seed(seed)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    return tensor


def tensor_from_bytes(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensor = torch.empty(shape, dtype=dtype)
    if data:
        _byte_view(tensor).copy_(torch.frombuffer(data, dtype=torch.uint8))
    return tensor


def test_torch_exposes_the_dtypes_this_suite_expects():
    assert len(TORCH_DTYPES) >= 40  # torch 2.13 builds tensors of 46 distinct dtypes
    assert torch.bfloat16 in TORCH_DTYPES and torch.float8_e4m3fn in TORCH_DTYPES


def test_the_table_covers_every_torch_dtype():
    missing = []
    for dtype in TORCH_DTYPES:
        try:
            canonical_dtype(str(dtype))
        except InvalidRequest:
            missing.append(str(dtype))
    assert not missing, f"torch has dtypes the wire table lacks: {missing}"


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_table_element_size_matches_torch(dtype):
    assert itemsize(str(dtype)) == torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("name", sorted(DTYPE_ATTRS))
def test_every_torch_attribute_name_is_accepted(name):
    # regression: torch.bit (an alias of torch.uint1) was the one attribute name refused
    assert canonical_dtype(name) == canonical_dtype(str(DTYPE_ATTRS[name]))
    assert canonical_dtype(f"torch.{name}") == canonical_dtype(name)


def test_wire_codes_are_unique_and_invertible():
    codes = [code for code, _ in dtypes.DTYPES.values()]
    assert len(set(codes)) == len(codes) and all(0 < c < 256 for c in codes)
    for name in dtypes.DTYPES:
        assert dtype_name(dtype_code(name)) == name


def test_unknown_names_and_codes_are_refused():
    with pytest.raises(InvalidRequest):
        canonical_dtype("float128")
    with pytest.raises(MalformedState):
        dtype_name(255)


@pytest.mark.parametrize("digest_alg", list(DigestAlg), ids=lambda a: a.label)
@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=str)
def test_every_dtype_round_trips_byte_exactly(dtype, digest_alg):
    shapes = {"matrix": (3, 5), "scalar": (), "empty": (0, 4), "vector": (7,)}
    tensors = {name: random_tensor(dtype, shape, seed=i) for i, (name, shape) in enumerate(shapes.items())}
    specs = [TensorSpec(name, str(dtype), tuple(t.shape)) for name, t in tensors.items()]
    blob = seal_object(KEY, Provenance("r"), [(spec, raw_bytes(tensors[spec.name])) for spec in specs],
                       keyring=KEYRING, state_id=bytes(16), version=1, digest_alg=digest_alg)
    expect = Expectation.for_ref(StateRef(KEY, "r", 0, bytes(16), 1), NS, tensors=tuple(specs))
    opened = open_sealed(blob, expect, KEYRING)
    for spec, view in opened.tensor_views():
        original = tensors[spec.name]
        assert spec.dtype == canonical_dtype(str(dtype)) and spec.shape == tuple(original.shape)
        restored_bytes = bytearray(view)
        assert restored_bytes == raw_bytes(original)
        restored = tensor_from_bytes(restored_bytes, dtype, spec.shape)  # and the tensor itself
        assert restored.dtype == dtype and restored.shape == original.shape
        assert torch.equal(_byte_view(restored), _byte_view(original))


def test_packed_quantized_dtypes_still_have_no_flat_byte_image():
    # when this fails, torch packs these consistently: move them into ROUND_TRIP_DTYPES
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in PACKED_QUANTIZED:
            tensor = torch.empty((4, 5), dtype=dtype)
            assert tensor.untyped_storage().nbytes() < tensor.nbytes == 20 * itemsize(str(dtype))


def test_one_object_with_a_tensor_of_every_dtype():
    tensors = [(TensorSpec(str(d), str(d), (2, 3)), raw_bytes(random_tensor(d, (2, 3), seed=i)))
               for i, d in enumerate(ROUND_TRIP_DTYPES)]
    blob = seal_object(KEY, Provenance("r"), tensors, keyring=KEYRING, state_id=bytes(16), version=1)
    opened = open_sealed(blob, Expectation.for_key(KEY, tensors=tuple(s for s, _ in tensors)), KEYRING)
    assert [(s, bytes(v)) for s, v in opened.tensor_views()] == [(s, bytes(b)) for s, b in tensors]
    assert all(t.offset % 64 == 0 for t in opened.header.tensors)
