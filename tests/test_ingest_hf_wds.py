"""Sources people already have: Hugging Face ``datasets`` folders (save_to_disk Arrow,
Parquet shards) and WebDataset tar shards: read in order with replayable positions,
and exactly once through producer kills like every file source."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import fsspec
import pytest
import webdataset as wds

from ingest_service.errors import SourceError
from ingest_service.sources.files import read_source
from ingest_service.sources.records import BadRecord, GoodRecord
from tests._ingest_util import expected_partitions, kill_at_random_points, read_partitions, values
from tests.servers import RedisServer
from trainguard.core import streams


def _spec(name: str, source: str, fmt: str, **kw: Any) -> streams.DatasetSpec:
    base: dict[str, Any] = dict(name=name, partitions=8, source=source, format=fmt, seed=5,
                                shuffle_buffer=300)
    base.update(kw)
    return streams.DatasetSpec(**base)


def _rows(n: int) -> dict[str, list[Any]]:
    return {"i": list(range(n)), "text": [f"row {i}" + "x" * (i % 5) for i in range(n)]}


def _save_hf(folder: Path, n: int, shards: int) -> str:
    datasets.Dataset.from_dict(_rows(n)).save_to_disk(str(folder), num_shards=shards)
    return str(folder)


def _write_wds(folder: Path, n: int, shards: int) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-n // shards)
    for s in range(shards):
        with wds.TarWriter(str(folder / f"shard-{s:04d}.tar")) as sink:
            for i in range(s * per, min(n, (s + 1) * per)):
                sink.write({"__key__": f"sample{i:06d}", "json": {"i": i},
                            "txt": f"text of {i}", "seg.bin": bytes([i % 256]) * (i % 7)})
    return str(folder / "*.tar")


def _good(items: list[GoodRecord | BadRecord]) -> list[Any]:
    return [streams.decode_record(i.fields) for i in items if isinstance(i, GoodRecord)]


def test_save_to_disk_folder_rows_in_order_with_shard_positions(tmp_path: Path) -> None:
    """A save_to_disk folder of 3 Arrow shards: every row once, in dataset order, as a
    dict of its columns, positioned ``<shard>:<row in shard>``; the metadata files are
    not records."""
    source = _save_hf(tmp_path / "ds", 1000, 3)
    items = list(read_source(_spec("h", source, "hf")))
    assert _good(items) == [{"i": i, "text": t} for i, t in zip(*_rows(1000).values())]
    shards = sorted(p.name for p in (tmp_path / "ds").glob("*.arrow"))
    assert len(shards) == 3
    assert items[0].pos.endswith(f"{shards[0]}:0".encode())
    assert items[-1].pos.endswith(f"{shards[2]}:{999 - 667}".encode())


def test_parquet_shards_and_fsspec_urls(tmp_path: Path) -> None:
    """The same dataset exported as Parquet shards reads the same rows; and a
    save_to_disk folder copied to another filesystem (memory://) reads through fsspec."""
    ds = datasets.Dataset.from_dict(_rows(500))
    (tmp_path / "pq").mkdir()
    for k in range(2):
        ds.shard(2, k, contiguous=True).to_parquet(str(tmp_path / "pq" / f"train-{k:05d}.parquet"))
    assert _good(list(read_source(_spec("p", str(tmp_path / "pq"), "hf")))) == ds.to_list()
    local = Path(_save_hf(tmp_path / "ds", 500, 2))
    mem = fsspec.filesystem("memory")
    for f in local.iterdir():
        mem.pipe(f"/hfcopy/{f.name}", f.read_bytes())
    assert _good(list(read_source(_spec("m", "memory://hfcopy", "hf")))) == ds.to_list()


def test_a_dataset_dict_folder_is_refused_with_its_splits(tmp_path: Path) -> None:
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(_rows(10)),
                               "test": datasets.Dataset.from_dict(_rows(4))})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(SourceError, match=r"DatasetDict of splits .*train.*: point the source"):
        list(read_source(_spec("d", str(tmp_path / "dd"), "hf")))
    assert len(_good(list(read_source(_spec("d", str(tmp_path / "dd" / "test"), "hf"))))) == 4


def test_webdataset_samples_group_by_key_across_shards(tmp_path: Path) -> None:
    """Files of one key form one sample (``seg.bin``: everything after the first dot
    is the field), samples come shard by shard in order, fields as raw bytes,
    positioned ``<shard>:<key>``; a gzip-compressed shard streams the same way."""
    source = _write_wds(tmp_path / "w", 30, 3)
    items = list(read_source(_spec("w", source, "webdataset")))
    samples = _good(items)
    assert [s["__key__"] for s in samples] == [f"sample{i:06d}" for i in range(30)]
    assert samples[8] == {"__key__": "sample000008", "json": b'{"i": 8}', "txt": b"text of 8",
                          "seg.bin": b"\x08"}
    assert items[12].pos.endswith(b"shard-0001.tar:sample000012")
    raw = (tmp_path / "w" / "shard-0000.tar").read_bytes()
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "s.tar.gz").write_bytes(gzip.compress(raw))
    assert _good(list(read_source(_spec("g", str(tmp_path / "gz"), "webdataset")))) == samples[:10]


def test_a_torn_tar_keeps_the_samples_before_the_break(tmp_path: Path) -> None:
    """A shard cut in the middle of a member, or between members: the complete samples
    before the cut are records, the open one is one undecodable dead letter, the next
    shard is read."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(6):
            for ext, data in (("txt", b"t" * 600), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"k{i}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    # A sample is 5 blocks of 512 bytes: the cut is inside k2's second member's data.
    (tmp_path / "a.tar").write_bytes(buf.getvalue()[:512 * 14 + 100])
    _write_wds(tmp_path / "b", 2, 1)
    (tmp_path / "b" / "shard-0000.tar").rename(tmp_path / "b.tar")
    # Cut between two samples, without the end-of-archive blocks: the last sample may
    # have lost members, so it is a dead letter too.
    (tmp_path / "c.tar").write_bytes(buf.getvalue()[:512 * 15])
    items = list(read_source(_spec("t", str(tmp_path / "*.tar"), "webdataset")))
    assert [s["__key__"] for s in _good(items)] == ["k0", "k1", "sample000000", "sample000001",
                                                    "k0", "k1"]
    bad = [i for i in items if isinstance(i, BadRecord)]
    assert [(b.reason, b.pos.rpartition("/")[2]) for b in bad] == [
        ("undecodable", "a.tar:k2"), ("undecodable", "c.tar:k2")]


def _check_every_row_once(url: str, spec: streams.DatasetSpec, total: int, key: Any) -> None:
    parts = read_partitions(url, spec)
    assert parts == expected_partitions(spec)  # same IDs, bytes and order as planned
    seen = Counter(key(v) for p in parts for v in values(p))
    assert sorted(seen) == list(range(total)) and set(seen.values()) == {1}


@pytest.mark.parametrize("fmt", ["hf", "webdataset"])
def test_kill_9_producer_every_record_once_in_order(
    redis_server: RedisServer, tmp_path: Path, fmt: str
) -> None:
    """The crash-resume test of the file sources, on 6,000 rows of a save_to_disk
    folder (4 shards) and 6,000 samples of WebDataset tars (4 shards): SIGKILL the
    producer at 6 random points, restart it each time; every record ends up exactly
    once, in planned order (deterministic IDs)."""
    total = 6_000
    if fmt == "hf":
        source = _save_hf(tmp_path / "ds", total, 4)
        key = lambda v: v["i"]  # noqa: E731
    else:
        source = _write_wds(tmp_path / "w", total, 4)
        key = lambda v: json.loads(v["json"])["i"]  # noqa: E731
    spec = _spec(f"k{fmt}", source, fmt)
    landed = kill_at_random_points(redis_server.url, spec, total, 6, seed=7)
    assert landed >= 4
    _check_every_row_once(redis_server.url, spec, total, key)
