"""Read large tensors' chunks straight into the caller's tensors, verifying in place.

The staged path (:class:`checkpoint_store.reader.ChunkReader`) reads every chunk into
a buffer of its own, verifies it, and only then copies into the caller's state:
nothing changes unless everything verified, at the price of a second pass over memory
and a second copy of the state in memory. Here a chunk's payload is read (``preadv``)
into the destination tensor's own memory in pieces of ``_PIECE`` bytes, and each
piece's CRC-32C is computed right after its read, while it is still in the CPU cache
(the ``crc32c`` package uses the hardware instruction). Chunks are read by a pool of
threads: both ``preadv`` and the CRC release the GIL.

The price: a damaged chunk is found after bytes of the checkpoint are already in the
caller's tensors. So the store uses this path only where it can recover from that by
reloading everything from an earlier checkpoint (see ``CheckpointStore.load``).

Which tensors qualify (:meth:`DirectLoad.claim`): a CPU, strided, C-contiguous tensor
that owns its whole storage (so no other target aliases its bytes), of at least
``_MIN_BYTES``, saved as one shard covering a whole array of its own. Everything else
goes through the staged path.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c as _crc
import numpy as np
import torch

from checkpoint_store.backends import Backend, LocalBackend
from checkpoint_store.zarr_format import CRC_BYTES, check_crc, check_size
from trainguard.core.checkpoints import CorruptCheckpointError

__all__ = ["DirectLoad"]

_PIECE = 1 << 20
"""Bytes read and checksummed at a time: small enough to stay in L2 between the two."""

_MIN_BYTES = 1 << 20
"""Smaller tensors gain nothing from the direct path (and are packed anyway)."""


@dataclass(frozen=True)
class _Job:
    path: str  # chunk file, relative to the root
    dest: memoryview  # the destination bytes of this chunk's payload
    pad: int  # padding bytes after the payload (last chunk only)
    expected_crc: int


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes, whatever its dtype."""
    buf = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return memoryview(buf).cast("B")


def _array_nbytes(meta: Mapping[str, Any]) -> int | None:
    try:
        itemsize = np.dtype(str(meta["data_type"])).itemsize
    except TypeError:
        return None
    n = itemsize
    for d in meta["shape"]:
        n *= int(d)
    return n


class DirectLoad:
    """Collects the tensors of one load that can be read in place, then reads them.

    Call order: :meth:`claim` for each tensor target during the load's dry walk (a
    claimed tensor is not fetched by the staged reader and not copied by ``apply``),
    then :meth:`run` once."""

    def __init__(self, backend: Backend, data_dir: str, arrays: Mapping[str, Mapping[str, Any]],
                 *, io_threads: int):
        self.backend = backend
        self.data_dir = data_dir
        self.arrays = arrays
        self.io_threads = io_threads
        self._jobs: list[_Job] = []
        self._storages: set[int] = set()
        self._claimed: list[torch.Tensor] = []

    def claim(self, target: torch.Tensor, entry: Mapping[str, Any]) -> bool:
        """Take ``target`` (already checked to match ``entry``'s dtype and shape) onto
        the direct path if it qualifies; True when taken."""
        nbytes = target.numel() * target.element_size()
        shards = entry["shards"]
        if (nbytes < _MIN_BYTES or target.device.type != "cpu"
                or target.layout != torch.strided or not target.is_contiguous()
                or target.is_conj() or target.is_neg() or len(shards) != 1):
            return False
        storage = target.untyped_storage()
        if target.storage_offset() != 0 or storage.nbytes() != nbytes:
            return False
        if storage.data_ptr() in self._storages:
            return False
        s = shards[0]
        meta = self.arrays.get(s["array"])
        if (meta is None or int(s["offset"]) != 0 or int(s["nbytes"]) != nbytes
                or any(int(o) for o in s["offsets"]) or _array_nbytes(meta) != nbytes):
            return False
        size = int(meta["chunk_bytes"])
        crcs = meta["crc32c"]
        if size <= 0 or len(crcs) != -(-nbytes // size):
            return False
        self._storages.add(storage.data_ptr())
        self._claimed.append(target)
        dest = _bytes_of(target)
        ndim = len(meta["shape"])
        for i, crc in enumerate(crcs):
            key = ".".join([str(i)] + ["0"] * (ndim - 1))
            part = dest[i * size : (i + 1) * size]
            self._jobs.append(_Job(f"{self.data_dir}/{s['array']}/{key}", part,
                                   size - len(part), int(crc)))
        return True

    def run(self) -> None:
        """Read and verify every claimed chunk into place. Raises
        CorruptCheckpointError on the first damaged chunk (the claimed tensors then
        hold a mix of old and new bytes: the caller must reload them)."""
        if not self._jobs:
            return
        read = self._read_local if isinstance(self.backend, LocalBackend) else self._read_other
        threads = min(self.io_threads, len(self._jobs))
        if threads <= 1:
            for job in self._jobs:
                read(job)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-direct") as pool:
                list(pool.map(read, self._jobs))
        for t in self._claimed:
            # Written behind autograd's back: tell it the tensor changed, as copy_ would.
            torch.autograd.graph.increment_version(t)

    def _read_other(self, job: _Job) -> None:
        pad = memoryview(bytearray(job.pad))
        trailer = memoryview(bytearray(CRC_BYTES))
        try:
            size = self.backend.read_into(job.path, [job.dest, pad, trailer])
        except FileNotFoundError as e:
            raise _missing(job.path) from e
        check_size(size, len(job.dest) + job.pad + CRC_BYTES, job.path)
        crc = _crc.crc32c(pad, value=_crc.crc32c(job.dest))
        check_crc(crc, trailer, job.expected_crc, job.path)

    def _read_local(self, job: _Job) -> None:
        assert isinstance(self.backend, LocalBackend)
        try:
            fd = os.open(self.backend.local_path(job.path), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise _missing(job.path) from e
        try:
            payload = len(job.dest) + job.pad
            check_size(os.fstat(fd).st_size, payload + CRC_BYTES, job.path)
            pieces = [job.dest[i : i + _PIECE] for i in range(0, len(job.dest), _PIECE)]
            if job.pad:
                pieces.append(memoryview(bytearray(job.pad)))
            crc = pos = 0
            for piece in pieces:
                pos += _pread_full(fd, piece, pos)
                crc = _crc.crc32c(piece, value=crc)
            trailer = memoryview(bytearray(CRC_BYTES))
            _pread_full(fd, trailer, payload)
            check_crc(crc, trailer, job.expected_crc, job.path)
        finally:
            os.close(fd)


def _pread_full(fd: int, dest: memoryview, offset: int) -> int:
    """Fill ``dest`` from ``offset``; a file that ends early is damage."""
    got = 0
    while got < len(dest):
        n = os.preadv(fd, [dest[got:]], offset + got)
        if n == 0:
            raise CorruptCheckpointError(
                f"a chunk file ended {len(dest) - got} bytes early while being read (it "
                "changed under the load); load an earlier checkpoint"
            )
        got += n
    return got


def _missing(path: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"chunk {path} is missing: the checkpoint is incomplete; load an earlier one"
    )
