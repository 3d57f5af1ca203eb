"""Read tensors' chunks straight into the caller's tensors, verifying in place.

The staged path (:class:`checkpoint_store.reader.ChunkReader`) reads every chunk into
a buffer of its own, verifies it, and only then copies into the caller's state:
nothing changes unless everything verified, at the price of a second pass over memory
and a second copy of the state in memory. Here each chunk file is read with
``preadv`` into a scatter list: the slices of the destination tensors its bytes
belong to, and small scratch buffers for what belongs to no claimed tensor (the
64-byte alignment gaps of the packed array, the last chunk's zero padding, bytes of a
tensor left to the staged path). The CRC-32C of each piece is computed right after
its read, while it is still in the CPU cache (the ``crc32c`` package uses the
hardware instruction), and the chunk's CRC is checked against its trailer and the
manifest. Chunks are read by a pool of threads: ``preadv`` and the CRC release the
GIL.

The price: a damaged chunk is found after bytes of the checkpoint are already in the
caller's tensors. So the store uses this path only where it can recover from that by
reloading everything from an earlier checkpoint (see ``CheckpointStore.load``).

Which tensors qualify (:meth:`DirectLoad.claim`): a CPU, strided, C-contiguous tensor
that owns its whole storage (so no other target aliases its bytes), saved as one
shard covering it. Everything else (``Shard`` targets, views, aliases) goes through
the staged path.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c as _crc
import torch

from checkpoint_store.backends import Backend, LocalBackend
from checkpoint_store.zarr_format import CRC_BYTES, check_crc, check_size
from trainguard.core.checkpoints import CorruptCheckpointError

__all__ = ["DirectLoad"]

_PIECE = 1 << 20
"""Bytes read and checksummed at a time: small enough to stay in L2 between the two."""

_IOV = 256
"""Most pieces per ``preadv`` (the kernel's limit is 1024)."""

Piece = memoryview | int
"""Part of a chunk's payload: a destination slice, or the length of a gap."""


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes, whatever its dtype."""
    buf = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return memoryview(buf).cast("B")


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
        # array -> [(byte offset in the array, destination bytes)]
        self._claims: dict[str, list[tuple[int, memoryview]]] = {}
        self._taken: set[tuple[str, int]] = set()
        self._storages: set[int] = set()
        self._claimed: list[torch.Tensor] = []

    def claim(self, target: torch.Tensor, entry: Mapping[str, Any]) -> bool:
        """Take ``target`` (already checked to match ``entry``'s dtype and shape) onto
        the direct path if it qualifies; True when taken."""
        nbytes = target.numel() * target.element_size()
        shards = entry["shards"]
        if (nbytes == 0 or target.device.type != "cpu" or target.layout != torch.strided
                or not target.is_contiguous() or target.is_conj() or target.is_neg()
                or len(shards) != 1):
            return False
        storage = target.untyped_storage()
        if (target.storage_offset() != 0 or storage.nbytes() != nbytes
                or storage.data_ptr() in self._storages):
            return False
        s = shards[0]
        meta = self.arrays.get(s["array"])
        offset = int(s["offset"])
        if (meta is None or int(s["nbytes"]) != nbytes or any(int(o) for o in s["offsets"])
                or (s["array"], offset) in self._taken):
            return False
        size = int(meta["chunk_bytes"])
        if size <= 0 or offset < 0 or offset + nbytes > size * len(meta["crc32c"]):
            return False  # the staged reader reports the damage
        self._taken.add((s["array"], offset))
        self._storages.add(storage.data_ptr())
        self._claimed.append(target)
        self._claims.setdefault(s["array"], []).append((offset, _bytes_of(target)))
        return True

    def _jobs(self) -> list[tuple[str, list[Piece], int]]:
        """``(chunk path, pieces covering its whole payload, manifest CRC)`` for every
        chunk holding claimed bytes."""
        jobs: list[tuple[str, list[Piece], int]] = []
        for array, claims in self._claims.items():
            meta = self.arrays[array]
            size = int(meta["chunk_bytes"])
            ndim = len(meta["shape"])
            claims.sort(key=lambda c: c[0])
            k = 0  # first claim that may reach into the current chunk
            chunks = sorted({i for off, dest in claims
                             for i in range(off // size, (off + len(dest) - 1) // size + 1)})
            for i in chunks:
                lo, hi = i * size, (i + 1) * size
                while k < len(claims) and claims[k][0] + len(claims[k][1]) <= lo:
                    k += 1
                pieces: list[Piece] = []
                cursor = lo
                j = k
                while j < len(claims) and claims[j][0] < hi:
                    off, dest = claims[j]
                    start = max(off, lo)
                    if start < cursor:
                        raise CorruptCheckpointError(
                            f"array {array} of {self.data_dir}: two tensors share bytes at "
                            f"{start}; the manifest is inconsistent"
                        )
                    if start > cursor:
                        pieces.append(start - cursor)
                    stop = min(off + len(dest), hi)
                    pieces.append(dest[start - off : stop - off])
                    cursor = stop
                    j += 1
                if cursor < hi:
                    pieces.append(hi - cursor)
                key = ".".join([str(i)] + ["0"] * (ndim - 1))
                jobs.append((f"{self.data_dir}/{array}/{key}", pieces, int(meta["crc32c"][i])))
        return jobs

    def run(self) -> None:
        """Read and verify every chunk holding claimed bytes, into place. Raises
        CorruptCheckpointError on a damaged chunk (the claimed tensors then hold a
        mix of old and new bytes: the caller must reload them)."""
        jobs = self._jobs()
        if not jobs:
            return
        local = isinstance(self.backend, LocalBackend)
        read = self._read_local if local else self._read_other
        threads = min(self.io_threads, len(jobs))
        if threads <= 1:
            for job in jobs:
                read(*job)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-direct") as pool:
                list(pool.map(lambda job: read(*job), jobs))
        for t in self._claimed:
            # Written behind autograd's back: tell it the tensor changed, as copy_ would.
            torch.autograd.graph.increment_version(t)

    def _read_other(self, path: str, pieces: list[Piece], expected_crc: int) -> None:
        views = [p if isinstance(p, memoryview) else memoryview(bytearray(p)) for p in pieces]
        trailer = memoryview(bytearray(CRC_BYTES))
        try:
            size = self.backend.read_into(path, [*views, trailer])
        except FileNotFoundError as e:
            raise _missing(path) from e
        check_size(size, sum(map(len, views)) + CRC_BYTES, path)
        crc = 0
        for v in views:
            crc = _crc.crc32c(v, value=crc)
        check_crc(crc, trailer, expected_crc, path)

    def _read_local(self, path: str, pieces: list[Piece], expected_crc: int) -> None:
        assert isinstance(self.backend, LocalBackend)
        try:
            fd = os.open(self.backend.local_path(path), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise _missing(path) from e
        try:
            payload = sum(p if isinstance(p, int) else len(p) for p in pieces)
            check_size(os.fstat(fd).st_size, payload + CRC_BYTES, path)
            crc = pos = 0
            for batch in _batches(pieces, memoryview(bytearray(_PIECE))):
                pos += _pread_full(fd, batch, pos)
                for v in batch:
                    crc = _crc.crc32c(v, value=crc)
            trailer = memoryview(bytearray(CRC_BYTES))
            _pread_full(fd, [trailer], payload)
            check_crc(crc, trailer, expected_crc, path)
        finally:
            os.close(fd)


def _batches(pieces: list[Piece], scratch: memoryview) -> list[list[memoryview]]:
    """The pieces as ``preadv`` lists of at most ``_PIECE`` bytes and ``_IOV`` entries.
    Large slices are cut; gaps read into ``scratch`` (``_PIECE`` bytes) at their place
    in their list, so one scratch serves a whole chunk: a list's CRC is taken before
    the next list is read."""
    out: list[list[memoryview]] = []
    cur: list[memoryview] = []
    used = 0
    for p in pieces:
        left = p if isinstance(p, int) else len(p)
        pos = 0
        while left:
            n = min(left, _PIECE - used)
            cur.append(scratch[used : used + n] if isinstance(p, int) else p[pos : pos + n])
            used += n
            pos += n
            left -= n
            if used == _PIECE or len(cur) == _IOV:
                out.append(cur)
                cur, used = [], 0
    if cur:
        out.append(cur)
    return out


def _pread_full(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill ``views`` in order from ``offset``; a file that ends early is damage."""
    want = sum(map(len, views))
    got = 0
    while got < want:
        rest, skip = [], got
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        n = os.preadv(fd, rest, offset + got)
        if n == 0:
            raise CorruptCheckpointError(
                f"a chunk file ended {want - got} bytes early while being read (it changed "
                "under the load); load an earlier checkpoint"
            )
        got += n
    return got


def _missing(path: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"chunk {path} is missing: the checkpoint is incomplete; load an earlier one"
    )
