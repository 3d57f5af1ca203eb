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

Which targets qualify (:meth:`DirectLoad.claim`): a CPU, strided, C-contiguous tensor
(a plain tensor, a ``Shard``'s tensor or a DTensor's local shard) whose storage no
other claimed target shares, and whose block the saved blocks give in whole rows:
the same layout, or blocks resharded along the first axis (FSDP2's ``Shard(0)`` on
another world size). A saved chunk only partly needed is still read whole (the rest
into scratch) so its CRC is checked. Column-resharded blocks, views of a claimed
storage and GPU tensors go through the staged path. Each array's ``zarr.json`` is
checked against the manifest's SHA-256, as the staged path does.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c as _crc
import torch

from checkpoint_store.backends import Backend, LocalBackend, open_chunk
from checkpoint_store.reader import check_zarr_json
from checkpoint_store.reshard import plan_region
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

    def claim(self, target: torch.Tensor, entry: Mapping[str, Any],
              offsets: tuple[int, ...] | None = None, *, where: str = "") -> bool:
        """Take ``target`` onto the direct path if it qualifies; True when taken.

        ``target`` (already checked to match ``entry``'s dtype) is the block at global
        ``offsets`` of the saved tensor (None: the whole tensor): a plain tensor, a
        ``Shard``'s tensor or a DTensor's local shard. It qualifies when every saved
        block it overlaps gives it whole rows (the layout of row-sharded blocks,
        FSDP2's ``Shard(0)`` included, resharded or not): each such run of rows is a
        contiguous byte range of both the array and the target."""
        shape = tuple(target.shape)
        nbytes = target.numel() * target.element_size()
        if (nbytes == 0 or target.device.type != "cpu" or target.layout != torch.strided
                or not target.is_contiguous() or target.is_conj() or target.is_neg()):
            return False
        storage = target.untyped_storage().data_ptr()
        if storage in self._storages:
            return False  # another target may alias these bytes: leave it to the stage
        offsets = offsets if offsets is not None else (0,) * len(shape)
        runs = _row_runs(entry["shards"], offsets, shape, nbytes,
                         where=where or f"a tensor of {self.data_dir}")
        if runs is None:
            return False
        for array, offset, _, length in runs:
            meta = self.arrays.get(array)
            if meta is None or (array, offset) in self._taken:
                return False
            size = int(meta["chunk_bytes"])
            if size <= 0 or offset < 0 or offset + length > size * len(meta["crc32c"]):
                return False  # the staged reader reports the damage
        dest = _bytes_of(target)
        for array, offset, start, length in runs:
            self._taken.add((array, offset))
            self._claims.setdefault(array, []).append((offset, dest[start : start + length]))
        self._storages.add(storage)
        self._claimed.append(target)
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

        def work(job: tuple[str, list[Piece], int] | str) -> None:
            if isinstance(job, str):
                check_zarr_json(self.backend, self.data_dir, job, self.arrays[job])
            else:
                read(*job)

        todo: list[tuple[str, list[Piece], int] | str] = [*sorted(self._claims), *jobs]
        threads = min(self.io_threads, len(todo))
        if threads <= 1:
            for job in todo:
                work(job)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-direct") as pool:
                list(pool.map(work, todo))
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
            fd = open_chunk(self.backend.local_path(path))
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


def _row_runs(shards: Any, offsets: tuple[int, ...], shape: tuple[int, ...], nbytes: int,
              *, where: str) -> list[tuple[str, int, int, int]] | None:
    """``(array, byte offset in it, byte offset in the target, length)`` for each saved
    block's rows the block ``[offsets, offsets + shape)`` needs, or None when some
    block does not give the target whole rows (a column-resharded load)."""
    runs = []
    row_bytes = nbytes // shape[0] if shape else nbytes
    for p in plan_region(shards, offsets, shape, where=where):
        if p.shape[1:] != shape[1:] or p.offsets[1:] != offsets[1:]:
            return None
        first = p.offsets[0] - offsets[0] if shape else 0
        if p.nbytes != (p.shape[0] * row_bytes if shape else nbytes):
            return None  # the manifest's sizes disagree: the staged reader reports it
        runs.append((p.array, p.offset, first * row_bytes, p.nbytes))
    return runs


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
