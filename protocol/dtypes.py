"""Tensor element types on the wire, without importing torch.

``DTYPES`` maps a dtype name (torch's spelling without ``torch.``) to its one-byte wire code
and its element size in bytes. Codes are stable: new types get new codes, none is reused.
``dtype_code(name)`` / ``dtype_name(code)`` translate, raising ``InvalidRequest`` /
``MalformedState`` for unknown entries. ``TensorSpec`` names one tensor of a payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .errors import InvalidRequest, MalformedState, quote_untrusted

# name: (code, element size in bytes). Sub-byte types are stored packed as torch stores them
# (one element per byte for the bits/intN families in torch today).
DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float64": (2, 8),
    "float16": (3, 2),
    "bfloat16": (4, 2),
    "float8_e4m3fn": (5, 1),
    "float8_e5m2": (6, 1),
    "float8_e4m3fnuz": (7, 1),
    "float8_e5m2fnuz": (8, 1),
    "float8_e8m0fnu": (9, 1),
    "float4_e2m1fn_x2": (10, 1),
    "complex32": (11, 4),
    "complex64": (12, 8),
    "complex128": (13, 16),
    "int8": (20, 1),
    "int16": (21, 2),
    "int32": (22, 4),
    "int64": (23, 8),
    "uint8": (24, 1),
    "uint16": (25, 2),
    "uint32": (26, 4),
    "uint64": (27, 8),
    "bool": (28, 1),
    "qint8": (30, 1),
    "quint8": (31, 1),
    "qint32": (32, 4),
    "quint4x2": (33, 1),
    "quint2x4": (34, 1),
    "bits1x8": (40, 1),
    "bits2x4": (41, 1),
    "bits4x2": (42, 1),
    "bits8": (43, 1),
    "bits16": (44, 2),
    "int1": (50, 1),
    "int2": (51, 1),
    "int3": (52, 1),
    "int4": (53, 1),
    "int5": (54, 1),
    "int6": (55, 1),
    "int7": (56, 1),
    "uint1": (60, 1),
    "uint2": (61, 1),
    "uint3": (62, 1),
    "uint4": (63, 1),
    "uint5": (64, 1),
    "uint6": (65, 1),
    "uint7": (66, 1),
}
# torch aliases that name the same type
_ALIASES = {"bit": "uint1", "chalf": "complex32", "cfloat": "complex64", "cdouble": "complex128",
            "half": "float16", "float": "float32", "double": "float64", "short": "int16", "int": "int32",
            "long": "int64"}
_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}

MAX_NDIM = 16
MAX_NAME_BYTES = 255


def canonical_dtype(name: str) -> str:
    name = name.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise InvalidRequest(f"unsupported dtype {quote_untrusted(name)}")
    return name


def dtype_code(name: str) -> int:
    return DTYPES[canonical_dtype(name)][0]


def dtype_name(code: int) -> str:
    try:
        return _BY_CODE[code]
    except KeyError:
        raise MalformedState(f"unknown dtype code {code}") from None


def itemsize(name: str) -> int:
    return DTYPES[canonical_dtype(name)][1]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of a payload: its name, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if len(self.name.encode("utf-8")) > MAX_NAME_BYTES:
            raise InvalidRequest(f"tensor name longer than {MAX_NAME_BYTES} bytes")
        if len(self.shape) > MAX_NDIM or any(not 0 <= d < 2**64 for d in self.shape):
            raise InvalidRequest(f"tensor {quote_untrusted(self.name)}: shape must have ≤ {MAX_NDIM} dims in "
                                 f"[0, 2**64)")

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * itemsize(self.dtype)
