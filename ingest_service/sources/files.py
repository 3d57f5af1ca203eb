"""Readers of file sources: fsspec URLs in, a stream of records (or bad records) out.

Every reader streams: it holds one line, one sample, one file (for ``files``) or one
row batch (for ``parquet``) at a time, never the whole source. Hugging Face
``datasets`` folders (``hf``) and WebDataset shards (``webdataset``) are read by
``hf`` and ``wds`` (both over :mod:`ingest_service.sources.records`). The order of the items
is a pure function of the source content: files are read in sorted path order, and
each file from its start. Bad records are not errors here: they come out as
:class:`BadRecord` with a reason, so the producer can dead-letter them and go on.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from typing import IO, Any

import fsspec
import numpy as np
from fsspec.utils import infer_compression

from ingest_service.errors import SourceError
from ingest_service.sources.hf import read_hf_file
from ingest_service.sources.records import (
    RAW,
    BadRecord,
    GoodRecord,
    Meta,
    SourceItem,
    check_size,
    fixed_size,
    structured,
)
from ingest_service.sources.wds import read_webdataset_file
from trainguard.core import streams

__all__ = ["list_source_files", "read_source"]


_READ_BLOCK = 256 * 1024
"""Bytes per read of fixed-size samples: one read per sample would be a system call
(and a Python call chain) per record."""


def list_source_files(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The files behind ``url`` (a file, a folder, or a glob), sorted by path."""
    try:
        fs, _, paths = fsspec.get_fs_token_paths(url, storage_options=dict(storage_options or {}))
    except (ValueError, ImportError) as exc:
        raise SourceError(f"source {url!r} cannot be opened: {exc}") from exc
    files: set[str] = set()
    for path in paths:
        if fs.isdir(path):
            files.update(p for p in fs.find(path) if not fs.isdir(p))
        elif fs.exists(path):
            files.add(path)
    if not files:
        raise SourceError(
            f"source {url!r} matches no file: expected a file, a folder or a glob with at "
            "least one match; check the URL and its storage options"
        )
    return fs, sorted(files)


def _open(fs: fsspec.AbstractFileSystem, path: str) -> IO[bytes]:
    return fs.open(path, "rb", compression=infer_compression(path))  # type: ignore[no-any-return]


def _read_lines(
    spec: streams.DatasetSpec, fs: fsspec.AbstractFileSystem, path: str, *, as_json: bool
) -> Iterator[SourceItem]:
    with _open(fs, path) as f:
        for lineno, line in enumerate(f, 1):
            body = line.rstrip(b"\r\n")
            if as_json and not body.strip():
                continue  # blank lines between JSON records are not records
            pos = f"{path}:{lineno}"
            if len(body) > spec.max_record_bytes:
                yield BadRecord(pos, "oversized",
                                f"{len(body)} bytes, limit {spec.max_record_bytes}", body)
                continue
            try:
                text = body.decode("utf-8")
                value = json.loads(text) if as_json else text
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                yield BadRecord(pos, "undecodable", str(exc), body)
                continue
            yield structured(spec, pos, value, body)


def _read_jsonl(spec: streams.DatasetSpec, fs: fsspec.AbstractFileSystem, path: str) -> Iterator[SourceItem]:
    return _read_lines(spec, fs, path, as_json=True)


def _read_text(spec: streams.DatasetSpec, fs: fsspec.AbstractFileSystem, path: str) -> Iterator[SourceItem]:
    return _read_lines(spec, fs, path, as_json=False)


def read_npy_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` file ``f`` is at the start of,
    leaving ``f`` at its data; ``ValueError`` when it is not one. Shared by the reader
    and by the ingest CLI's up-front record count, so both read a file alike."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)  # type: ignore[no-any-return]
    return np.lib.format.read_array_header_2_0(f)  # type: ignore[no-any-return]


def _read_npy(spec: streams.DatasetSpec, fs: fsspec.AbstractFileSystem, path: str) -> Iterator[SourceItem]:
    """Token arrays cut into records of ``sample_len`` tokens (C order, flattened); the
    tail shorter than one sample is not a record."""
    sample_len = int(spec.sample_len or 0)
    with _open(fs, path) as f:
        try:
            shape, fortran, dtype = read_npy_header(f)
        except ValueError as exc:
            yield BadRecord(path, "undecodable", f"not a .npy file: {exc}", b"")
            return
        if dtype.hasobject or (fortran and len(shape) > 1):
            yield BadRecord(path, "schema", f"expected a C-order numeric array, got {dtype} "
                            f"fortran_order={fortran}", b"")
            return
        total = int(np.prod(shape)) if shape else 1
        step = sample_len * dtype.itemsize
        meta: Meta = ((streams.F_KIND, streams.KIND_NDARRAY),
                      (streams.F_DTYPE, dtype.str.encode()),
                      (streams.F_SHAPE, str(sample_len).encode()))
        fixed = fixed_size(meta) + step
        limit = spec.max_record_bytes
        path_b = path.encode()
        samples = total // sample_len if sample_len else 0
        # Large samples are read one at a time: the read's own bytes object is then the
        # record (a whole-range slice of bytes is the same object), one copy less.
        per_read = 1 if step >= _READ_BLOCK // 4 else _READ_BLOCK // max(step, 1)
        make = functools.partial(tuple.__new__, GoodRecord)  # _make without its Python frame
        done = 0
        while done < samples:
            want = min(per_read, samples - done)
            block = f.read(want * step)
            # A complete read has every sample (also when samples are 0 bytes and it read
            # nothing); a short one has the whole samples it holds.
            got = want if len(block) == want * step else len(block) // step
            starts = range(done * sample_len, (done + got) * sample_len, sample_len)
            positions = [b"%b:%d" % (path_b, start) for start in starts]
            chunks = [block[i * step:(i + 1) * step] for i in range(got)]
            if not positions or fixed + len(positions[-1]) <= limit:
                # The common case, built from C: positions only grow, so the last one
                # is the longest.
                yield from map(make, zip(chunks, positions, itertools.repeat(meta)))
            else:
                for pos, chunk in zip(positions, chunks):
                    if fixed + len(pos) > limit:
                        yield BadRecord(pos.decode(), "oversized",
                                        f"{fixed + len(pos)} bytes, limit {limit}", chunk)
                    else:
                        yield GoodRecord(chunk, pos, meta)
            if got < want:
                start = (done + got) * sample_len
                yield BadRecord(f"{path}:{start}", "undecodable",
                                f"file ends inside sample at token {start}", block[got * step:])
                return
            done += got


def _read_file(spec: streams.DatasetSpec, fs: fsspec.AbstractFileSystem, path: str) -> Iterator[SourceItem]:
    size = fs.size(path)
    if size is not None and size > spec.max_record_bytes:
        with _open(fs, path) as f:
            head = f.read(streams.DL_PAYLOAD_LIMIT)
        yield BadRecord(path, "oversized", f"{size} bytes, limit {spec.max_record_bytes}", head)
        return
    with _open(fs, path) as f:
        data = f.read()
    yield check_size(spec, path, RAW, data)


def _read_parquet(spec: streams.DatasetSpec, fs: fsspec.AbstractFileSystem, path: str) -> Iterator[SourceItem]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise SourceError(
            "parquet sources need pyarrow: install trainguard[parquet]"
        ) from exc
    with _open(fs, path) as f:
        row = 0
        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
            for value in batch.to_pylist():
                pos = f"{path}:{row}"
                row += 1
                yield structured(spec, pos, value, json.dumps(value, default=str).encode())


_READERS: dict[streams.SourceFormat, Callable[[streams.DatasetSpec, fsspec.AbstractFileSystem, str], Iterator[SourceItem]]] = {
    "jsonl": _read_jsonl,
    "text": _read_text,
    "npy": _read_npy,
    "files": _read_file,
    "parquet": _read_parquet,
    "hf": read_hf_file,
    "webdataset": read_webdataset_file,
}


def read_source(
    spec: streams.DatasetSpec, storage_options: Mapping[str, Any] | None = None
) -> Iterator[SourceItem]:
    """Every record of ``spec.source`` once, in source order (one epoch, unshuffled)."""
    reader = _READERS.get(spec.format)
    if reader is None:
        raise SourceError(f"dataset {spec.name!r} of format {spec.format!r} has no file source")
    fs, files = list_source_files(spec.source, storage_options)
    for path in files:
        yield from reader(spec, fs, path)
