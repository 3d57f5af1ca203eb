"""An asynchronous save that stages into the store's own chunk files (the RAM tier).

A save with ``blocking=False`` must copy the state before it returns: the training
loop changes the tensors next. Copied into a host buffer (``staging.BufferPool``),
that is a second full copy of the state beside the one the writer then puts in the
tier's files. A store whose root is memory (tmpfs: the RAM tier) copies the state
straight into its chunk files instead: the staged copy IS the checkpoint's data once
committed, so a save holds one copy of the state beside the live one, not two.

Foreground (the caller's thread, before ``save`` returns; a one-process store only):
the uid is chosen and the in-flight marker written, as ``saving.run_save`` would do,
then every chunk file is created with its payload and 4 zero bytes where its CRC-32C
goes (``stage_files``). Where every chunk has a dropped checkpoint's spare file of its
size (``_page_reuse``), the foreground only copies into them (``stage_in_spares``),
and uid, marker and the spares' move into the data directory are the writer's.
Background (the writer thread, ``seal_rank``): each chunk is read back in small pieces
to compute its CRC (so the CRC pins the bytes that landed), the trailer is written in
place and the file fsync'd; then the arrays' metadata, and ``run_save`` commits as
always (manifest by exclusive create, then LATEST). A crash anywhere before the
manifest leaves a data directory and the marker of a dead process (or spares of one),
debris that ``gc`` (or the next store to open the root) removes, like that of any torn
save; nothing is committed.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

import crc32c as _crc

from checkpoint_store import _faults
from checkpoint_store._page_reuse import ChunkMaps, copy_into
from checkpoint_store.backends import LocalBackend
from checkpoint_store.flatten import TensorLeaf
from checkpoint_store.plan import RankPlan
from checkpoint_store.staging import Segment, direct_segments
from checkpoint_store.writer import chunk_pieces, write_arrays
from checkpoint_store.zarr_format import CRC_BYTES, ArrayLayout, zero_bytes
from trainguard.core.checkpoints import CheckpointError

__all__ = ["SEAL_PIECE_BYTES", "STAGING_PHASE", "Spares", "seal_rank", "stage_files",
           "stage_in_spares"]

STAGING_PHASE = "mid-staging"
"""The fault phase (``_faults``) reached once the first chunk file is staged."""
SEAL_PIECE_BYTES = 1 << 20
"""What one read of a chunk being sealed holds, per I/O thread: the whole extra
memory of the background half of the save."""


def stage_files(backend: LocalBackend, data_dir: str, plan: RankPlan,
                leaves: Sequence[TensorLeaf], maps: ChunkMaps | None = None) -> None:
    """Write every chunk file of ``plan`` under ``data_dir`` from ``leaves``: payload
    (zeros in gaps and padding) and a zeroed CRC trailer that :func:`seal_rank` fills
    in; into a spare's pages where ``maps`` has one of the size (``_page_reuse``).
    Runs in the caller's thread: on return the state may change."""
    if maps is not None:
        maps.fit(_sizes(plan))
    try:
        for n, (path, pieces) in enumerate(_chunks(plan, leaves)):
            rel = f"{data_dir}/{path}"
            if maps is None or not maps.write(rel, pieces):
                backend.write_file(rel, pieces)
            if n == 0:
                _faults.reached(STAGING_PHASE)
    except BaseException:
        if maps is not None:  # the caller deletes the files: no mapping may keep their pages
            maps.forget(data_dir)
            maps.fit([])
        raise


Spares = list[tuple[str, str, mmap.mmap]]
"""Chunks copied into claimed spares, not yet placed: ``(spare, chunk path relative to
the data directory, mapping)``, for :meth:`ChunkMaps.place` in the writer thread."""


def _sizes(plan: RankPlan) -> list[int]:
    """Each chunk file's size: every one whole (padded), with its trailer."""
    return [layout.chunk_bytes + CRC_BYTES for layout in plan.arrays
            for _ in range(layout.nchunks)]


def _chunks(plan: RankPlan, leaves: Sequence[TensorLeaf]) -> list[tuple[str, list[Any]]]:
    """Each chunk file of ``plan``: its path under the data directory and its pieces
    (payload, zeros in gaps and padding, the zeroed CRC trailer)."""
    by_array: dict[str, list[Segment]] = {}
    for seg in sorted(direct_segments(leaves, plan), key=lambda s: (s.array, s.offset)):
        by_array.setdefault(seg.array, []).append(seg)
    out = []
    for layout in plan.arrays:
        for index in range(layout.nchunks):
            pieces = chunk_pieces(layout, by_array.get(layout.path, []), index)
            pieces.extend(zero_bytes(CRC_BYTES))
            out.append((layout.chunk_path(index), pieces))
    return out


def stage_in_spares(plan: RankPlan, leaves: Sequence[TensorLeaf],
                    maps: ChunkMaps) -> Spares | None:
    """Copy every chunk of ``plan`` into a spare of its size, when there is one for
    each (else None, nothing taken: the caller stages new files). Nothing is renamed,
    no uid chosen, no marker written: the writer thread does that before it seals
    (``saving.run_save``), so the caller's thread only copies. A crash before then
    leaves spares of a dead process, which the next store to open the root removes."""
    claimed = maps.claim(_sizes(plan))
    if claimed is None:
        return None  # stage_files fits the pool to the files it writes
    maps.fit([])  # the spares this save does not take: none is kept between saves
    chunks = _chunks(plan, leaves)
    try:
        for n, ((_, pieces), (_, m)) in enumerate(zip(chunks, claimed, strict=True)):
            copy_into(m, pieces)
            if n == 0:
                _faults.reached(STAGING_PHASE)
    except BaseException:
        maps.discard(claimed)
        raise
    return [(spare, rel, m) for (rel, _), (spare, m) in zip(chunks, claimed, strict=True)]


def seal_rank(backend: LocalBackend, data_dir: str, plan: RankPlan, *,
              io_threads: int, maps: ChunkMaps | None = None,
              spares: Spares | None = None) -> dict[str, dict[str, Any]]:
    """Checksum the chunk files :func:`stage_files` wrote, write their trailers, then
    the rank's metadata (``writer.write_arrays``); returns the manifest ``arrays``
    entries, as ``write_rank`` does. With ``maps``, each file is read through its
    mapping, which stays open for the save that rewrites it (``_page_reuse``); the
    mappings of files deleted by another path are closed here, off the loop's path."""
    if spares and maps is not None:  # staged by stage_in_spares: into place first
        moves = [(spare, f"{data_dir}/{rel}", m) for spare, rel, m in spares]
        spares.clear()  # the placement's now: it deletes what it cannot move
        maps.place(moves)
    if maps is not None:
        maps.prune()
    local = threading.local()

    def seal(layout: ArrayLayout, index: int) -> int:
        rel = f"{data_dir}/{layout.chunk_path(index)}"
        size = layout.chunk_bytes
        fd = os.open(backend.local_path(rel), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            found = os.fstat(fd).st_size
            if found != size + CRC_BYTES:
                raise CheckpointError(
                    f"the staged chunk {rel} holds {found} bytes, expected {size + CRC_BYTES}: "
                    "something else wrote into the store's root during the save; nothing "
                    "was committed, save again")
            if maps is not None:
                m = maps.mapped(rel)
                if m is None:
                    m = maps.hold(rel, fd)
                with memoryview(m) as whole, whole[:size] as payload:
                    crc = _crc.crc32c(payload)
            else:
                if not hasattr(local, "view"):
                    local.view = memoryview(bytearray(SEAL_PIECE_BYTES))
                view: memoryview = local.view
                crc, pos = 0, 0
                while pos < size:
                    n = os.preadv(fd, [view[:min(len(view), size - pos)]], pos)
                    if n == 0:
                        raise CheckpointError(f"the staged chunk {rel} shrank while it was sealed")
                    crc = _crc.crc32c(view[:n], value=crc)
                    pos += n
            os.pwrite(fd, struct.pack("<I", crc), size)
            os.fsync(fd)
        finally:
            os.close(fd)
        return crc

    return write_arrays(backend, data_dir, plan, seal, io_threads=io_threads)
