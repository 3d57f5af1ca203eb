"""The structure of a manifest's ``arrays`` and ``tensors``, checked when it is parsed.

A manifest's checksum proves it was written whole, not that its writer was sound: a
buggy or forged one with a valid checksum must still be refused as damaged
(CorruptCheckpointError), so that a load falls back to the previous checkpoint instead
of dividing by a zero chunk size, indexing past a CRC list, allocating a tensor its
bytes cannot fill, or naming a dtype nothing can read. Every figure here is one the
writer derives (``ArrayLayout``, ``plan_rank``), so a manifest that passes is one the
readers can walk without further checks. Messages name the field, never byte values.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from checkpoint_store.dtypes import dtype_from_name, is_supported
from trainguard.core.checkpoints import CorruptCheckpointError

__all__ = ["MAX_CHUNK_BYTES", "MAX_STATE_BYTES", "ZARR_ITEMSIZE", "check_content",
           "check_structure"]

ZARR_ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2,
    "uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8, "float64": 8,
    "complex64": 8, "complex128": 16,
}
"""The Zarr ``data_type`` names a save writes (``dtypes.zarr_data_type``), by width."""

MAX_CHUNK_BYTES = 1 << 34
"""A chunk is read into one buffer: a size past this (16 GiB) is no save's."""

MAX_STATE_BYTES = 64 << 20
"""The msgpack state skeleton holds the non-tensor values only (hyperparameters,
counters, random states): past 64 MiB it is not a skeleton this store wrote."""


def _bad(name: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"manifest {name}: {what}; the manifest is damaged or forged (its checksum holds, "
        "so its writer was faulty): load an earlier checkpoint"
    )


def _count(value: Any) -> TypeGuard[int]:
    return type(value) is int and value >= 0


def _dims(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(_count(d) for d in value)


def _check_array(name: str, path: str, meta: Any) -> int:
    """One ``arrays`` entry; returns its size in bytes (chunks times chunk size)."""
    if not isinstance(meta, dict):
        raise _bad(name, f"array {path[:80]!r} is not an object")
    shape, data_type = meta.get("shape"), meta.get("data_type")
    rows, size, crcs = meta.get("chunk_rows"), meta.get("chunk_bytes"), meta.get("crc32c")
    if not _dims(shape) or not shape:
        raise _bad(name, f"array {path[:80]!r} has no valid shape (a list of integers >= 0)")
    itemsize = ZARR_ITEMSIZE.get(data_type) if isinstance(data_type, str) else None
    if itemsize is None:
        raise _bad(name, f"array {path[:80]!r} has an unknown data_type: expected one of "
                         f"{sorted(ZARR_ITEMSIZE)}")
    if not _count(rows) or rows == 0 or not _count(size) or size == 0:
        raise _bad(name, f"array {path[:80]!r} needs chunk_rows and chunk_bytes > 0")
    if size != rows * math.prod(shape[1:]) * itemsize or size > MAX_CHUNK_BYTES:
        raise _bad(name, f"array {path[:80]!r}: chunk_bytes is not chunk_rows rows of its "
                         "shape and data_type")
    chunks = -(-shape[0] // rows)
    if not isinstance(crcs, list) or len(crcs) not in {chunks, max(chunks, 1)} \
            or not all(_count(c) and c < 1 << 32 for c in crcs):
        raise _bad(name, f"array {path[:80]!r}: crc32c must list one unsigned 32-bit CRC per "
                         "chunk")
    return len(crcs) * size


def _check_shard(name: str, key: str, shard: Any, global_shape: list[int], itemsize: int,
                 arrays: dict[str, int]) -> int:
    if not isinstance(shard, dict):
        raise _bad(name, f"tensor {key[:80]!r} has a shard that is not an object")
    nbytes, offset, shape = shard.get("nbytes"), shard.get("offset"), shard.get("shape")
    offsets = shard.get("offsets")
    if not _count(nbytes) or not _count(offset) or not _dims(shape) or not _dims(offsets):
        raise _bad(name, f"tensor {key[:80]!r} has a shard without integer nbytes, offset, "
                         "shape and offsets")
    if len(shape) != len(global_shape) or len(offsets) != len(global_shape) or any(
            o + n > g for o, n, g in zip(offsets, shape, global_shape, strict=True)):
        raise _bad(name, f"tensor {key[:80]!r} has a shard outside the tensor's shape")
    if nbytes != math.prod(shape) * itemsize:
        raise _bad(name, f"tensor {key[:80]!r} has a shard whose nbytes is not its shape "
                         "times the dtype's width")
    if nbytes:
        array = arrays.get(shard.get("array"))  # type: ignore[arg-type]
        if array is None or offset + nbytes > array:
            raise _bad(name, f"tensor {key[:80]!r} has a shard outside the arrays the "
                             "manifest lists")
    return nbytes


def _check_tensor(name: str, key: str, entry: Any, arrays: dict[str, int],
                  whole: bool = True) -> None:
    if not isinstance(entry, dict):
        raise _bad(name, f"tensor {key[:80]!r} is not an object")
    dtype_text, shape, shards = entry.get("dtype"), entry.get("shape"), entry.get("shards")
    try:
        dtype = dtype_from_name(dtype_text) if isinstance(dtype_text, str) else None
    except ValueError:
        dtype = None
    if dtype is None or not is_supported(dtype):
        raise _bad(name, f"tensor {key[:80]!r} has an unknown or unsupported dtype")
    if not _dims(shape) or not isinstance(shards, list):
        raise _bad(name, f"tensor {key[:80]!r} needs a shape (integers >= 0) and a shard list")
    stored = sum(_check_shard(name, key, s, shape, dtype.itemsize, arrays) for s in shards)
    # The tensor is allocated at its global size before its bytes are read: bytes its
    # shards cannot fill mean a shape that is not the one saved. (Some ranks' blocks
    # only, ``whole=False``: the loader checks that they cover each block it reads.)
    if whole and math.prod(shape) * dtype.itemsize > stored:
        raise _bad(name, f"tensor {key[:80]!r}: its shape and dtype need more bytes than "
                         "its shards hold")


def check_structure(name: str, body: dict[str, Any], state_chars: int) -> None:
    """Raise CorruptCheckpointError unless ``arrays`` and ``tensors`` are consistent
    with each other and the state (``state_chars`` base64 characters) is bounded."""
    created = body["created_at"]
    if type(created) not in (int, float) or not math.isfinite(created) \
            or type(body["world_size"]) is not int or body["world_size"] < 1 \
            or not _count(body["nbytes"]) or not isinstance(body["extra"], dict) \
            or not (body["parent"] is None or isinstance(body["parent"], str)):
        raise _bad(name, "created_at, world_size, nbytes, extra or parent is not of its type "
                         "(FORMAT.md)")
    if state_chars > MAX_STATE_BYTES * 4 // 3 + 4:
        raise _bad(name, f"the state skeleton is larger than {MAX_STATE_BYTES >> 20} MiB")
    check_content(name, body["arrays"], body["tensors"])


def check_content(name: str, arrays: Any, tensors: Any, *, whole: bool = True) -> None:
    """Raise CorruptCheckpointError unless ``arrays`` and ``tensors`` (a manifest's, or
    those a format 4 checkpoint's rank objects hold together) fit each other.
    ``whole=False``: the objects of some ranks only, whose blocks need not fill a
    tensor."""
    if not isinstance(arrays, dict):
        raise _bad(name, "'arrays' is not an object")
    sizes = {path: _check_array(name, str(path), meta) for path, meta in arrays.items()}
    if not isinstance(tensors, dict):
        raise _bad(name, "'tensors' is not an object")
    for key, entry in tensors.items():
        _check_tensor(name, str(key), entry, sizes, whole)
