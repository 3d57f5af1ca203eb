"""WebDataset tar shards as a source (format ``webdataset``).

A shard is a tar of files grouped into samples by key: the member path up to the
first dot of its file name (``a/0001.jpg`` and ``a/0001.cls`` are sample ``a/0001``
with fields ``jpg`` and ``cls``), consecutive members of one key making one sample,
as WebDataset writes them. Shards are read in path order as streams over fsspec
(``.tar``, or compressed ``.tar.gz``: never seeked, never unpacked to disk), each
sample becoming a msgpack record ``{"__key__": key, "<ext>": bytes, ...}`` at position
``<shard>:<key>``, so IDs are replayable like any file source's. A tar that breaks
mid-stream ends its shard with one ``undecodable`` dead letter; the samples before
it stay, the open one goes with the dead letter.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.utils import infer_compression

from ingest_service.sources import BadRecord, SourceItem, _structured
from trainguard.core import streams

__all__ = ["read_webdataset_file", "split_key"]


def split_key(member: str) -> tuple[str, str]:
    """``"a/0001.seg.png"`` -> ``("a/0001", "seg.png")`` (WebDataset's convention)."""
    folder, base = posixpath.split(member)
    stem, dot, ext = base.partition(".")
    return posixpath.join(folder, stem) if folder else stem, ext if dot else ""


def _sample(spec: streams.DatasetSpec, path: str, key: str, fields: dict[str, Any]) -> SourceItem:
    value = {"__key__": key, **fields}
    shown = {k: (v if isinstance(v, str) else f"<{len(v)} bytes>") for k, v in value.items()}
    return _structured(spec, f"{path}:{key}", value, json.dumps(shown).encode())


def read_webdataset_file(spec: streams.DatasetSpec, fs: fsspec.AbstractFileSystem,
                         path: str) -> Iterator[SourceItem]:
    key: str | None = None
    fields: dict[str, Any] = {}
    members = 0
    with fs.open(path, "rb", compression=infer_compression(path)) as f:
        try:
            with tarfile.open(fileobj=f, mode="r|") as tar:
                for member in tar:
                    members += 1
                    if not member.isfile():
                        continue
                    k, ext = split_key(member.name)
                    if k != key or ext in fields:
                        if key is not None:
                            yield _sample(spec, path, key, fields)
                        key, fields = k, {}
                    data = tar.extractfile(member)
                    fields[ext] = data.read() if data is not None else b""
        except (tarfile.TarError, EOFError, OSError) as exc:
            # The open sample may miss members: it goes to the dead letters with the break.
            where = f"{path}:{key}" if key is not None else f"{path}:#{members}"
            key = None
            yield BadRecord(where, "undecodable",
                            f"tar shard breaks after {members} members: {exc}", b"")
    if key is not None:
        yield _sample(spec, path, key, fields)
