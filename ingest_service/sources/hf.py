"""Hugging Face ``datasets`` folders as a source (format ``hf``).

A folder written by ``Dataset.save_to_disk`` holds Arrow IPC stream shards
(``data-00000-of-00002.arrow``...) beside ``state.json`` and ``dataset_info.json``; a
dataset exported as Parquet (``to_parquet``, or the hub's ``data/train-*.parquet``
layout) holds ``.parquet`` shards. Either is read shard by shard in path order
(``save_to_disk`` numbers its shards, so path order is row order) and row batch by
row batch, with pyarrow over fsspec: local paths and remote URLs alike, and without
the ``datasets`` package. Each row becomes a msgpack record (a dict of its columns);
its position is ``<shard>:<row in shard>``, so IDs are as replayable as any file
source's. Metadata files are skipped; a ``DatasetDict`` folder (several splits) is
refused with the split folders to choose from.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from typing import Any

import fsspec

from ingest_service.errors import SourceError
from ingest_service.sources.records import BadRecord, SourceItem, structured
from trainguard.core import streams

__all__ = ["read_hf_file"]

_ROWS_PER_BATCH = 1024


def _pyarrow() -> Any:
    try:
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise SourceError("hf sources need pyarrow: pip install 'trainguard[parquet]'") from exc
    return pyarrow


def _batches(pa: Any, f: Any, path: str) -> Iterator[Any]:
    if path.endswith(".parquet"):
        yield from pa.parquet.ParquetFile(f).iter_batches(batch_size=_ROWS_PER_BATCH)
        return
    head = f.read(6)
    f.seek(0)
    # save_to_disk writes the IPC stream format; an Arrow file (``ARROW1`` magic) is
    # read the same way through its file reader.
    if head == b"ARROW1":
        reader = pa.ipc.open_file(f)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from pa.ipc.open_stream(f)


def read_hf_file(spec: streams.DatasetSpec, fs: fsspec.AbstractFileSystem,
                 path: str) -> Iterator[SourceItem]:
    name = posixpath.basename(path)
    if name == "dataset_dict.json":
        splits = json.loads(fs.cat_file(path)).get("splits", [])
        raise SourceError(
            f"{posixpath.dirname(path)!r} is a DatasetDict of splits {splits}: point the "
            "source at one split's folder (e.g. .../train)"
        )
    if not name.endswith((".arrow", ".parquet")):
        return  # state.json, dataset_info.json, README.md...
    pa = _pyarrow()
    row = 0
    with fs.open(path, "rb") as f:
        try:
            for batch in _batches(pa, f, path):
                for value in batch.to_pylist():
                    pos = f"{path}:{row}"
                    row += 1
                    yield structured(spec, pos, value, json.dumps(value, default=str).encode())
        except (pa.ArrowInvalid, OSError, EOFError) as exc:
            yield BadRecord(f"{path}:{row}", "undecodable",
                            f"shard unreadable after {row} rows: {exc}", b"")
