"""How many records one epoch of a source holds, when the source says so up front.

The progress line of ``trainguard ingest`` (:mod:`trainguard.ops.ingest_progress`)
otherwise learns an epoch's size only once the producer has planned the whole epoch:
for a single-epoch ingest, that is near its end. Some sources know their size without
being read: an ``.npy`` header holds its shape, a ``files`` source is one record per
file (its size says whether it is oversized), and a Hugging Face folder's Parquet
footers or ``dataset_info.json`` hold their rows. For those the whole is shown from
the start; every other source (lines to parse, tokenized or packed records) says
None and the line waits for the producer's own count, as before.

The count follows the readers' own rules (:mod:`ingest_service.sources.files`), so it
is the number of good records the planner deals out; where a rule cannot be checked
without reading (an oversized row of a Parquet or Arrow shard), the producer's count,
once it has one, replaces this one (:func:`trainguard.ops.ingest_cli._count`).
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from trainguard.core import streams

__all__ = ["epoch_records_up_front"]


def epoch_records_up_front(spec: streams.DatasetSpec) -> int | None:
    """Good records in one epoch of ``spec``'s source, or None when only reading it
    would tell (or it cannot be opened: the producer reports that itself)."""
    if spec.options or not spec.source:
        return None  # tokenized or packed: records are made while reading
    counter = _COUNTERS.get(spec.format)
    if counter is None:
        return None
    from ingest_service.errors import SourceError
    from ingest_service.sources.files import list_source_files

    try:
        fs, files = list_source_files(spec.source)
        total = 0
        for path in files:
            n = counter(spec, fs, path, files)
            if n is None:
                return None
            total += n
        return total
    except (SourceError, OSError, ValueError):
        return None


def _npy(spec: streams.DatasetSpec, fs: Any, path: str, files: list[str]) -> int | None:
    import numpy as np
    from fsspec.utils import infer_compression

    from ingest_service.sources.files import read_npy_header
    from ingest_service.sources.records import fixed_size

    sample_len = int(spec.sample_len or 0)
    with fs.open(path, "rb", compression=infer_compression(path)) as f:
        try:
            shape, fortran, dtype = read_npy_header(f)
        except ValueError:
            return 0  # not an .npy file: one dead letter, no record
        if dtype.hasobject or (fortran and len(shape) > 1):
            return 0
        header_end = f.tell()
    total = int(np.prod(shape)) if shape else 1
    samples = total // sample_len if sample_len else 0
    if samples == 0:
        return 0
    step = sample_len * dtype.itemsize
    size = None if infer_compression(path) else fs.size(path)
    if size is not None and size - header_end < samples * step:
        return None  # a truncated file: the reader stops where its data ends
    meta = ((streams.F_KIND, streams.KIND_NDARRAY), (streams.F_DTYPE, dtype.str.encode()),
            (streams.F_SHAPE, str(sample_len).encode()))
    longest = len(f"{path}:{(samples - 1) * sample_len}".encode())
    if fixed_size(meta) + step + longest > spec.max_record_bytes:
        return None  # some samples are oversized: which, only the reader's rule says
    return samples


def _files(spec: streams.DatasetSpec, fs: Any, path: str, files: list[str]) -> int | None:
    from ingest_service.sources.records import RAW, fixed_size

    size = fs.size(path)
    if size is None:
        return None
    return int(fixed_size(RAW) + size + len(path.encode()) <= spec.max_record_bytes)


def _hf(spec: streams.DatasetSpec, fs: Any, path: str, files: list[str]) -> int | None:
    name = posixpath.basename(path)
    if name == "dataset_dict.json":
        return None  # refused by the reader, with the splits to choose from
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            return int(pq.ParquetFile(f).metadata.num_rows)
    if name.endswith(".arrow"):
        # save_to_disk's IPC streams have no footer: the folder's dataset_info.json
        # holds the rows of its split (counted once, on the first shard).
        return _rows_of_folder(fs, path, files)
    return 0  # state.json, README.md...: no records


def _rows_of_folder(fs: Any, path: str, files: list[str]) -> int | None:
    folder = posixpath.dirname(path)
    shards = sorted(p for p in files if posixpath.dirname(p) == folder and p.endswith(".arrow"))
    on_disk = sorted(str(p) for p in fs.ls(folder, detail=False) if str(p).endswith(".arrow"))
    if shards != on_disk:
        return None  # a glob of some shards: the folder's count is not theirs
    if shards[0] != path:
        return 0
    try:
        info = json.loads(fs.cat_file(posixpath.join(folder, "dataset_info.json")))
    except (FileNotFoundError, ValueError):
        return None
    splits = info.get("splits") or {}
    if len(splits) != 1:
        return None
    rows = next(iter(splits.values())).get("num_examples")
    return int(rows) if isinstance(rows, int) else None


_COUNTERS = {"npy": _npy, "files": _files, "hf": _hf, "parquet": _hf}
