"""Read byte ranges of a save's arrays, verifying every chunk touched.

Chunks are fetched in parallel, checked against their own CRC and the manifest's, and
kept until the load is applied, so a load either has all its bytes verified or
changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from checkpoint_store.backends import Backend
from checkpoint_store.errors import CorruptCheckpointError
from checkpoint_store.flatten import decode_skeleton
from checkpoint_store.layout import data_dir
from checkpoint_store.manifest import Manifest
from checkpoint_store.zarr_format import decode_chunk

__all__ = ["ChunkReader", "verify_data"]


class ChunkReader:
    def __init__(
        self, backend: Backend, data_dir: str, arrays: Mapping[str, Mapping[str, Any]],
        *, io_threads: int,
    ):
        self.backend = backend
        self.data_dir = data_dir
        self.arrays = arrays
        self.io_threads = io_threads
        self._chunks: dict[tuple[str, int], memoryview] = {}

    def _chunk_range(self, array: str, offset: int, nbytes: int) -> range:
        size = int(self.arrays[array]["chunk_bytes"])
        return range(offset // size, (offset + nbytes - 1) // size + 1)

    def _load_chunk(self, array: str, index: int) -> memoryview:
        meta = self.arrays[array]
        ndim = len(meta["shape"])
        key = ".".join([str(index)] + ["0"] * (ndim - 1))
        path = f"{self.data_dir}/{array}/{key}"
        try:
            raw = self.backend.read_buffer(path)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"chunk {path} is missing: the checkpoint is incomplete; load an earlier one"
            ) from e
        return decode_chunk(
            raw, expected_len=int(meta["chunk_bytes"]),
            expected_crc=int(meta["crc32c"][index]), where=path,
        )

    def fetch(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        """Read and verify every chunk that ``(array, offset, nbytes)`` ranges touch."""
        wanted: set[tuple[str, int]] = set()
        for array, offset, nbytes in ranges:
            if nbytes == 0:
                continue
            if array not in self.arrays:
                raise CorruptCheckpointError(
                    f"the manifest places a tensor in array {array!r}, which it does not list"
                )
            wanted.update((array, i) for i in self._chunk_range(array, offset, nbytes))
        todo = sorted(wanted - self._chunks.keys())
        if len(todo) <= 1 or self.io_threads <= 1:
            for key in todo:
                self._chunks[key] = self._load_chunk(*key)
            return
        with ThreadPoolExecutor(self.io_threads, thread_name_prefix="ckpt-read") as pool:
            for key, data in zip(todo, pool.map(lambda k: self._load_chunk(*k), todo)):
                self._chunks[key] = data

    def drop(self) -> None:
        """Forget fetched chunks (``verify`` streams through a checkpoint)."""
        self._chunks.clear()

    def read(self, array: str, offset: int, nbytes: int) -> memoryview:
        """Bytes ``[offset, offset + nbytes)`` of ``array`` (fetched on demand)."""
        if nbytes == 0:
            return memoryview(b"")
        self.fetch([(array, offset, nbytes)])
        size = int(self.arrays[array]["chunk_bytes"])
        indices = self._chunk_range(array, offset, nbytes)
        if len(indices) == 1:
            start = offset - indices[0] * size
            return self._chunks[(array, indices[0])][start : start + nbytes]
        out = bytearray(nbytes)
        pos = 0
        for i in indices:
            chunk = self._chunks[(array, i)]
            lo = max(offset, i * size) - i * size
            hi = min(offset + nbytes, (i + 1) * size) - i * size
            out[pos : pos + hi - lo] = chunk[lo:hi]
            pos += hi - lo
        return memoryview(out)


def verify_data(backend: Backend, manifest: Manifest, *, io_threads: int) -> None:
    """Check a committed save's data against its manifest: every chunk's CRC (one
    chunk in memory at a time), the state skeleton, and that every tensor lies inside
    its array. Raises CorruptCheckpointError."""
    reader = ChunkReader(backend, data_dir(manifest.uid), manifest.arrays,
                         io_threads=io_threads)
    for path, meta in manifest.arrays.items():
        for i in range(len(meta["crc32c"])):
            reader.fetch([(path, i * int(meta["chunk_bytes"]), 1)])
            reader.drop()
    decode_skeleton(manifest.state)
    for key, entry in manifest.tensors.items():
        for s in entry["shards"]:
            meta = manifest.arrays.get(s["array"])
            if s["nbytes"] and (meta is None or s["offset"] + s["nbytes"] >
                                len(meta["crc32c"]) * int(meta["chunk_bytes"])):
                raise CorruptCheckpointError(
                    f"tensor {key!r} of {manifest.name} points outside its array"
                )
