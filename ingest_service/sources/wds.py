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
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.utils import infer_compression

from ingest_service.errors import SourceError
from ingest_service.sources.records import BadRecord, SourceItem, structured
from trainguard.core import streams

__all__ = ["read_webdataset_file", "split_key"]


def split_key(member: str) -> tuple[str, str]:
    """``"a/0001.seg.png"`` -> ``("a/0001", "seg.png")`` (WebDataset's convention)."""
    folder, base = posixpath.split(member)
    stem, dot, ext = base.partition(".")
    return posixpath.join(folder, stem) if folder else stem, ext if dot else ""


class TornTarError(SourceError, ValueError):
    """The shard is not a complete tar (cut, or a damaged header)."""


_BLOCK = 512


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes over 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.strip(b"\0 ")
    return int(text, 8) if text else 0


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of a pax extended header (``"<len> path=<value>\n"``...)."""
    path = None
    while data:
        length, _, rest = data.partition(b" ")
        n = int(length)
        key, _, value = rest[:n - len(length) - 2].partition(b"=")
        if key == b"path":
            path = value.decode("utf-8")
        data = data[n:]
    return path


def _members(f: IO[bytes]) -> Iterator[tuple[str, bytes]]:
    """(name, content) of each regular file of a tar stream, in order.

    A small reader of ustar, GNU and pax headers rather than ``tarfile``: ``tarfile``
    spends about 0.2 ms on a member (pax headers twice), and silently ends a shard cut
    inside a header. Here a cut anywhere, a header that fails its checksum, or a
    stream that ends without the end-of-archive blocks raises TornTarError."""
    long_name: str | None = None
    while True:
        header = f.read(_BLOCK)
        if len(header) < _BLOCK:
            raise TornTarError("the shard ends without the end-of-archive blocks (cut?)")
        if header == bytes(_BLOCK):
            return
        stored = _octal(header[148:156])
        if stored != sum(header[:148]) + 256 + sum(header[156:]):
            raise TornTarError("a header fails its checksum")
        size = _octal(header[124:136])
        kind = header[156:157]
        data = f.read(size)
        if len(data) < size:
            raise TornTarError(f"the shard ends inside a member ({len(data)} of {size} bytes)")
        f.read(-size % _BLOCK)
        if kind in (b"x", b"L"):  # the next member's name
            long_name = _pax_path(data) if kind == b"x" else data.rstrip(b"\0").decode("utf-8")
            continue
        if kind not in (b"0", b"\0", b"7"):
            long_name = None
            continue  # folders, links, global pax headers: not sample files
        name = long_name
        long_name = None
        if name is None:
            name = header[:100].split(b"\0", 1)[0].decode("utf-8")
            if header[257:262] == b"ustar":
                prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8")
                name = f"{prefix}/{name}" if prefix else name
        yield name, data


def _sample(spec: streams.DatasetSpec, path: str, key: str, fields: dict[str, Any]) -> SourceItem:
    value = {"__key__": key, **fields}
    shown = {k: (v if isinstance(v, str) else f"<{len(v)} bytes>") for k, v in value.items()}
    return structured(spec, f"{path}:{key}", value, json.dumps(shown).encode())


def read_webdataset_file(spec: streams.DatasetSpec, fs: fsspec.AbstractFileSystem,
                         path: str) -> Iterator[SourceItem]:
    key: str | None = None
    fields: dict[str, Any] = {}
    members = 0
    with fs.open(path, "rb", compression=infer_compression(path)) as f:
        try:
            for name, data in _members(f):
                members += 1
                k, ext = split_key(name)
                if k != key or ext in fields:
                    if key is not None:
                        yield _sample(spec, path, key, fields)
                    key, fields = k, {}
                fields[ext] = data
        except (TornTarError, ValueError, EOFError, OSError) as exc:
            # The open sample may miss members: it goes to the dead letters with the break.
            where = f"{path}:{key}" if key is not None else f"{path}:#{members}"
            key = None
            yield BadRecord(where, "undecodable",
                            f"tar shard breaks after {members} members: {exc}", b"")
    if key is not None:
        yield _sample(spec, path, key, fields)
