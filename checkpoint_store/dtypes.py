"""Torch dtypes <-> stored names, and the raw-bit views that move any dtype as bytes.

Every tensor is copied and stored as its raw little-endian bits. Dtypes that numpy and
Zarr know keep their Zarr ``data_type``; the rest (bfloat16, float8 variants,
complex32, bit and sub-byte types) are stored as the unsigned integer of the same
width, and the manifest (and the array's ``torch_dtype`` attribute) records the dtype.
Quantized dtypes carry scales outside their storage and are refused.
"""

from __future__ import annotations

import sys

import torch

__all__ = [
    "dtype_from_name",
    "dtype_name",
    "is_supported",
    "raw_view",
    "zarr_data_type",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is LE
    raise ImportError("checkpoint_store stores little-endian bytes and needs an LE host")

_ZARR_NATIVE: dict[torch.dtype, str] = {
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint16: "uint16",
    torch.uint32: "uint32",
    torch.uint64: "uint64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}
# Same-width integer dtypes used to move bits; complex128 (16 bytes) has none and
# moves as itself, which every torch copy kernel supports.
_RAW: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}

_BY_NAME: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d not in _QUANTIZED
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name stored in the manifest)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown torch dtype {name!r} in checkpoint") from None


def is_supported(dtype: torch.dtype) -> bool:
    return dtype not in _QUANTIZED and (dtype.itemsize in _RAW or dtype == torch.complex128)


def zarr_data_type(dtype: torch.dtype) -> str:
    """The Zarr v3 ``data_type`` of an array holding this dtype (raw bits if needed)."""
    native = _ZARR_NATIVE.get(dtype)
    if native is not None:
        return native
    return f"uint{8 * dtype.itemsize}"


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as a same-width type that every copy kernel supports."""
    if t.dtype == torch.complex128:
        return t
    raw = _RAW[t.dtype.itemsize]
    return t if t.dtype == raw else t.view(raw)
