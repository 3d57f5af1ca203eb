"""Execute a rank's plan: write every chunk file and ``zarr.json``, durably.

Chunk files are written in parallel (I/O threads release the GIL in ``os.write`` and
``fsync``); each is fsync'd, then every directory that received entries. The CRC-32C of
each chunk is returned for the manifest, which thereby pins the exact bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

from checkpoint_store import _faults
from checkpoint_store.backends import Backend
from checkpoint_store.layout import rank_group
from checkpoint_store.plan import RankPlan
from checkpoint_store.staging import Segment
from checkpoint_store.zarr_format import ArrayLayout, crc32c, group_metadata, zero_bytes

__all__ = ["chunk_pieces", "write_arrays", "write_rank", "write_root_group"]

Piece = bytes | memoryview


def chunk_pieces(layout: ArrayLayout, segments: Sequence[Segment], index: int) -> list[Piece]:
    """Bytes of chunk ``index``: segment slices, zeros in gaps and in the padding."""
    size = layout.chunk_bytes
    start, end = index * size, (index + 1) * size
    pieces: list[Piece] = []
    cursor = start
    for seg in segments:
        seg_end = seg.offset + len(seg.data)
        if seg_end <= start or seg.offset >= end:
            continue
        lo, hi = max(start, seg.offset), min(end, seg_end)
        if lo > cursor:
            pieces.extend(zero_bytes(lo - cursor))
        pieces.append(seg.data[lo - seg.offset : hi - seg.offset])
        cursor = hi
    if cursor < end:
        pieces.extend(zero_bytes(end - cursor))
    return pieces


def _run_all(jobs: Sequence[Callable[[], None]], io_threads: int) -> None:
    """Run every job; the first failure cancels what has not started and is raised."""
    if io_threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(io_threads, thread_name_prefix="ckpt-io") as pool:
        futures: list[Future[None]] = [pool.submit(job) for job in jobs]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            f.cancel()
        for f in futures:
            if not f.cancelled():
                f.result()


def _json_bytes(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def write_root_group(backend: Backend, data_dir: str, attributes: dict[str, Any]) -> None:
    backend.write_file(f"{data_dir}/zarr.json", [_json_bytes(group_metadata(attributes))])


def write_rank(
    backend: Backend,
    data_dir: str,
    plan: RankPlan,
    segments: Sequence[Segment],
    *,
    io_threads: int,
) -> dict[str, dict[str, Any]]:
    """Write the rank's group, arrays and chunks; returns the manifest ``arrays`` entries."""
    by_array: dict[str, list[Segment]] = {}
    for seg in sorted(segments, key=lambda s: (s.array, s.offset)):
        by_array.setdefault(seg.array, []).append(seg)

    def write_chunk(layout: ArrayLayout, index: int) -> int:
        pieces = chunk_pieces(layout, by_array.get(layout.path, []), index)
        crc = crc32c(pieces)
        pieces.append(struct.pack("<I", crc))
        backend.write_file(f"{data_dir}/{layout.chunk_path(index)}", pieces)
        return crc

    return write_arrays(backend, data_dir, plan, write_chunk, io_threads=io_threads)


def write_arrays(
    backend: Backend,
    data_dir: str,
    plan: RankPlan,
    write_chunk: Callable[[ArrayLayout, int], int],
    *,
    io_threads: int,
) -> dict[str, dict[str, Any]]:
    """The rank's group, its arrays' metadata and every chunk by ``write_chunk(layout,
    index)`` (which returns the chunk's CRC-32C), then every directory fsync'd; returns
    the manifest ``arrays`` entries. ``write_rank`` writes chunks from segments, the
    file staging of ``_file_staging`` seals chunks staged before."""
    group = f"{data_dir}/{rank_group(plan.rank)}"
    backend.write_file(f"{group}/zarr.json", [_json_bytes(group_metadata())])
    crcs: dict[str, list[int]] = {a.path: [0] * a.nchunks for a in plan.arrays}
    written = 0
    lock = threading.Lock()

    def one_chunk(layout: ArrayLayout, index: int) -> None:
        nonlocal written
        crcs[layout.path][index] = write_chunk(layout, index)
        with lock:
            written += 1
            first = written == 1
        if first:
            _faults.reached("mid-data")

    metadata = {a.path: _json_bytes(a.metadata()) for a in plan.arrays}

    def write_metadata(layout: ArrayLayout) -> None:
        backend.write_file(f"{data_dir}/{layout.path}/zarr.json", [metadata[layout.path]])

    # Every file is its own job: fsyncs of many small files overlap instead of queueing.
    jobs: list[Callable[[], None]] = [partial(write_metadata, a) for a in plan.arrays]
    jobs += [partial(one_chunk, a, i) for a in plan.arrays for i in range(a.nchunks)]
    _run_all(jobs, io_threads)
    dirs = [f"{data_dir}/{a.path}" for a in plan.arrays]
    _run_all([partial(backend.sync_dirs, [d]) for d in dirs], io_threads)
    backend.sync_dirs([group, data_dir])
    return {
        a.path: {
            "shape": list(a.shape),
            "data_type": a.data_type,
            "chunk_rows": a.chunk_rows,
            "chunk_bytes": a.chunk_bytes,
            "crc32c": crcs[a.path],
            # The array's zarr.json, exactly as written: a reader that trusts its
            # data_type or shape checks them against this first.
            "zarr_json_sha256": hashlib.sha256(metadata[a.path]).hexdigest(),
        }
        for a in plan.arrays
    }
