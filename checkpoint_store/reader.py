"""Read byte ranges of a save's arrays, verifying every chunk touched.

Chunks are fetched in parallel, checked against their own CRC and the manifest's, and
kept until the load is applied, so a load either has all its bytes verified or
changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from checkpoint_store.backends import Backend, aligned_buffer
from checkpoint_store.flatten import decode_skeleton
from checkpoint_store.layout import data_dir
from checkpoint_store.manifest import Manifest
from checkpoint_store.zarr_format import CRC_BYTES, check_chunk
from trainguard.core.checkpoints import CorruptCheckpointError

__all__ = ["ChunkReader", "verify_data"]


class ChunkReader:
    """Each run of consecutive chunks of an array is read into one aligned buffer, a
    chunk's payload straight into its place (one read, no intermediate copy), so a
    tensor spanning chunks is a view of that buffer rather than a reassembled copy."""

    def __init__(
        self, backend: Backend, data_dir: str, arrays: Mapping[str, Mapping[str, Any]],
        *, io_threads: int,
    ):
        self.backend = backend
        self.data_dir = data_dir
        self.arrays = arrays
        self.io_threads = io_threads
        # (array, chunk index) -> (run number, the run's buffer, chunk's byte offset in it)
        self._chunks: dict[tuple[str, int], tuple[int, memoryview, int]] = {}
        self._runs = 0

    def _chunk_range(self, array: str, offset: int, nbytes: int) -> range:
        size = int(self.arrays[array]["chunk_bytes"])
        return range(offset // size, (offset + nbytes - 1) // size + 1)

    def _load_chunk(self, array: str, index: int, payload: memoryview) -> None:
        meta = self.arrays[array]
        ndim = len(meta["shape"])
        key = ".".join([str(index)] + ["0"] * (ndim - 1))
        path = f"{self.data_dir}/{array}/{key}"
        trailer = memoryview(bytearray(CRC_BYTES))
        try:
            size = self.backend.read_into(path, [payload, trailer])
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"chunk {path} is missing: the checkpoint is incomplete; load an earlier one"
            ) from e
        check_chunk(payload, trailer, size, expected_crc=int(meta["crc32c"][index]),
                    where=path)

    def _plan_runs(self, todo: list[tuple[str, int]]
                   ) -> list[tuple[str, int, int, memoryview, int]]:
        """``(array, index, run number, run buffer, offset)`` for each chunk in ``todo``
        (sorted), one fresh buffer per run of consecutive indices of one array."""
        jobs: list[tuple[str, int, int, memoryview, int]] = []
        i = 0
        while i < len(todo):
            array, first = todo[i]
            j = i + 1
            while j < len(todo) and todo[j] == (array, first + j - i):
                j += 1
            size = int(self.arrays[array]["chunk_bytes"])
            buf = aligned_buffer((j - i) * size)
            self._runs += 1
            jobs.extend((array, first + k, self._runs, buf, k * size) for k in range(j - i))
            i = j
        return jobs

    def fetch(self, ranges: Iterable[tuple[str, int, int]]) -> None:
        """Read and verify every chunk that ``(array, offset, nbytes)`` ranges touch;
        nothing is kept unless all of them verify."""
        wanted: set[tuple[str, int]] = set()
        for array, offset, nbytes in ranges:
            if nbytes == 0:
                continue
            if array not in self.arrays:
                raise CorruptCheckpointError(
                    f"the manifest places a tensor in array {array!r}, which it does not list"
                )
            wanted.update((array, i) for i in self._chunk_range(array, offset, nbytes))
        jobs = self._plan_runs(sorted(wanted - self._chunks.keys()))

        def load(job: tuple[str, int, int, memoryview, int]) -> None:
            array, index, _, buf, pos = job
            size = int(self.arrays[array]["chunk_bytes"])
            self._load_chunk(array, index, buf[pos : pos + size])

        if len(jobs) <= 1 or self.io_threads <= 1:
            for job in jobs:
                load(job)
        else:
            # Reads and CRC-32C release the GIL, so chunks are checked in parallel too.
            with ThreadPoolExecutor(min(self.io_threads, len(jobs)),
                                    thread_name_prefix="ckpt-read") as pool:
                list(pool.map(load, jobs))
        for array, index, run, buf, pos in jobs:
            self._chunks[(array, index)] = (run, buf, pos)

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
        run, buf, pos = self._chunks[(array, indices[0])]
        start = pos + offset - indices[0] * size
        if all(self._chunks[(array, i)][0] == run for i in indices):
            # Consecutive chunks of one run are adjacent in its buffer.
            return buf[start : start + nbytes]
        out = aligned_buffer(nbytes)
        done = 0
        for i in indices:
            _, buf, pos = self._chunks[(array, i)]
            lo = max(offset, i * size) - i * size
            hi = min(offset + nbytes, (i + 1) * size) - i * size
            out[done : done + hi - lo] = buf[pos + lo : pos + hi]
            done += hi - lo
        return out


def verify_data(backend: Backend, manifest: Manifest, *, io_threads: int) -> None:
    """Check a committed save's data against its manifest: every chunk's CRC (one
    chunk in memory at a time), the state skeleton, and that every tensor lies inside
    its array. Raises CorruptCheckpointError."""
    _check_zarr_json(backend, manifest)
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


def _check_zarr_json(backend: Backend, manifest: Manifest) -> None:
    """Each array's zarr.json against the SHA-256 its manifest recorded (format 2; a
    version 1 manifest has none)."""
    for path, meta in manifest.arrays.items():
        expected = meta.get("zarr_json_sha256")
        if expected is None:
            continue
        where = f"{data_dir(manifest.uid)}/{path}/zarr.json"
        try:
            raw = backend.read(where)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{where} is missing: the checkpoint is incomplete") \
                from e
        if hashlib.sha256(raw).hexdigest() != expected:
            raise CorruptCheckpointError(
                f"{where} does not match the SHA-256 in {manifest.name}: the array's "
                "metadata is damaged; load an earlier checkpoint"
            )
