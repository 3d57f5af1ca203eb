"""Zarr v3 arrays as this store writes them: metadata documents and chunk files.

Each array is C-ordered, chunked along its first axis only, with the codec chain
``bytes(little) -> crc32c`` and the ``v2`` chunk key encoding (``"0"``, ``"1.0.0"``):
a chunk file is the chunk's raw bytes followed by their CRC-32C (4 bytes, little
endian), exactly what ``zarr.codecs.Crc32cCodec`` writes and verifies. Because the
chunk boundaries fall on whole rows, an array is one byte stream cut into equal
chunks (the last one padded with zeros), which lets one writer and one reader serve
every array. See FORMAT.md.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import crc32c as _crc

from trainguard.core.checkpoints import CorruptCheckpointError

__all__ = [
    "CRC_BYTES", "ArrayLayout", "check_chunk", "check_crc", "check_size", "crc32c",
    "group_metadata", "zero_bytes",
]

CRC_BYTES = 4
_ZEROS = bytes(1 << 20)


def crc32c(pieces: Sequence[bytes | bytearray | memoryview]) -> int:
    value = 0
    for p in pieces:
        value = _crc.crc32c(p, value=value)
    return value


def zero_bytes(n: int) -> list[memoryview]:
    """``n`` zero bytes as views of one shared buffer (no allocation per chunk)."""
    out = []
    while n > 0:
        k = min(n, len(_ZEROS))
        out.append(memoryview(_ZEROS)[:k])
        n -= k
    return out


def _fill_value(data_type: str) -> Any:
    if data_type == "bool":
        return False
    if data_type.startswith("complex"):
        return [0.0, 0.0]
    if data_type.startswith("float"):
        return 0.0
    return 0


@dataclass(frozen=True)
class ArrayLayout:
    """One Zarr array of a save: where it lives, its shape and how it is chunked.

    ``path`` is relative to the save's data directory (``r0/pack``, ``r0/t3``).
    ``nbytes`` is the logical size; every chunk file holds ``chunk_bytes`` (+ CRC)."""

    path: str
    shape: tuple[int, ...]
    data_type: str
    itemsize: int
    chunk_rows: int
    attributes: dict[str, Any]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_rows * self.row_bytes

    @property
    def nchunks(self) -> int:
        return -(-self.shape[0] // self.chunk_rows)

    def chunk_key(self, index: int) -> str:
        return ".".join([str(index)] + ["0"] * (len(self.shape) - 1))

    def chunk_path(self, index: int) -> str:
        return f"{self.path}/{self.chunk_key(index)}"

    def metadata(self) -> dict[str, Any]:
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.data_type,
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [self.chunk_rows, *self.shape[1:]]},
            },
            "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
            "fill_value": _fill_value(self.data_type),
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
            "attributes": self.attributes,
        }

    @staticmethod
    def chunked(
        path: str,
        shape: tuple[int, ...],
        data_type: str,
        itemsize: int,
        *,
        target_chunk_bytes: int,
        attributes: dict[str, Any],
        row_multiple: int = 1,
    ) -> ArrayLayout:
        """Cut into about ``target_chunk_bytes`` per chunk, rows split evenly so the
        padded last chunk wastes little; ``row_multiple`` keeps chunk starts aligned."""
        row_bytes = max(1, math.prod(shape[1:]) * itemsize)
        nchunks = max(1, -(-(shape[0] * row_bytes) // target_chunk_bytes))
        rows = max(1, -(-shape[0] // nchunks))
        rows = min(-(-rows // row_multiple) * row_multiple, max(shape[0], 1))
        return ArrayLayout(path, shape, data_type, itemsize, rows, attributes)


def group_metadata(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def check_size(file_size: int, expected_size: int, where: str) -> None:
    if file_size != expected_size:
        raise CorruptCheckpointError(
            # No sizes: an API answer quoting this must not describe a foreign file.
            f"chunk {where} does not have the size its manifest gives: "
            "the file is truncated or foreign; load an earlier checkpoint"
        )


def check_crc(actual: int, trailer: memoryview, expected_crc: int, where: str) -> None:
    """``actual`` (the CRC-32C computed over a chunk's payload) against the chunk's
    own trailer and the CRC the manifest recorded (which also catches a valid chunk
    from another save). Raises CorruptCheckpointError."""
    (stored,) = struct.unpack("<I", trailer)
    if actual != stored or actual != expected_crc:
        raise CorruptCheckpointError(
            # No CRC values: they are bytes of the file (its last four) and a digest of it.
            f"chunk {where} fails its CRC-32C check "
            f"({'its own trailer' if actual != stored else 'the manifest'} disagrees): "
            "the data is damaged; load an earlier checkpoint"
        )


def check_chunk(payload: memoryview, trailer: memoryview, file_size: int, *,
                expected_crc: int, where: str) -> None:
    """Check a chunk file read as ``payload`` + ``trailer`` (its 4 CRC bytes): its
    size, its own CRC and the manifest's. Raises CorruptCheckpointError."""
    check_size(file_size, len(payload) + CRC_BYTES, where)
    check_crc(_crc.crc32c(payload), trailer, expected_crc, where)
