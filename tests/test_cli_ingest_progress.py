"""``trainguard ingest``'s progress line: the dataset's whole with a percentage, then
this process's share, labelled as such (several producers may share a dataset)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LINE = re.compile(r"dataset (?P<done>[\d,]+)/(?P<whole>[\d,]+) records \((?P<pct>[\d.]+) %\)"
                   r"  ETA (?P<eta>\S+)  \|  this process: (?P<mine>[\d,]+) records")


def _ingest(url: str, source: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", "ingest", "--redis-url", url, "--dataset", "docs",
         "--source", str(source), "--partitions", "4", "--epochs", "3", "--shuffle-buffer", "16"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def _last(proc: subprocess.CompletedProcess[str]) -> re.Match[str]:
    assert proc.returncode == 0, proc.stderr
    match = _LINE.search(proc.stderr.strip().splitlines()[-1])
    assert match, proc.stderr
    return match


def _n(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_last_line_shows_the_exact_whole_at_100_percent_and_labels_the_share(
        redis_server, tmp_path: Path) -> None:
    """A 3-epoch dataset of 1,001 records (not a multiple of the 4 partitions; one bad
    line, which is no record): the last line says 3,003 of 3,003 records, 100.0 %, and
    this process's 3,003 as its own. Run again, the dataset is still 3,003 of 3,003 at
    100.0 % while this process's share is 0: the two counts are not the same thing."""
    source = tmp_path / "docs.jsonl"
    lines = [json.dumps({"i": i}) for i in range(1001)]
    lines.insert(500, "{not json")
    source.write_text("\n".join(lines) + "\n")

    first = _last(_ingest(redis_server.url, source))
    assert (_n(first["done"]), _n(first["whole"]), first["pct"], _n(first["mine"])) == (
        3003, 3003, "100.0", 3003)
    assert first["eta"] == "0:00:00"

    again = _last(_ingest(redis_server.url, source))
    assert (_n(again["done"]), _n(again["whole"]), again["pct"], _n(again["mine"])) == (
        3003, 3003, "100.0", 0)


def test_a_producer_resumed_in_a_later_epoch_ends_at_the_exact_whole(
        redis_server, tmp_path: Path) -> None:
    """Stopped (SIGTERM) in epoch 2 of 3 and run again: the second process's last line
    says 60,000 of 60,000 records, 100.0 %, and its own share is exactly what the first
    one had not written (the dataset's count is read from the partitions' last IDs
    across epochs, not from what this process appended)."""
    from tests._ingest_util import total_len, write_jsonl
    from trainer_client import redis_client as trainer_redis
    from trainguard.core import streams

    write_jsonl(tmp_path, 20_000)
    args = [sys.executable, "-m", "trainguard", "ingest", "--redis-url", redis_server.url,
            "--dataset", "later", "--source", str(tmp_path / "*.jsonl"), "--partitions", "4",
            "--epochs", "3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    spec = streams.DatasetSpec(name="later", partitions=4, source=str(tmp_path / "*.jsonl"),
                               epochs=3)
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    client = trainer_redis.client(redis_server.url)
    try:
        while proc.poll() is None and total_len(client, spec) < 22_000:
            time.sleep(0.005)
        assert proc.poll() is None, "finished before the signal: make the source bigger"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        before = total_len(client, spec)
        assert 20_000 < before < 60_000
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
    again = _last(subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True,
                                 timeout=300))
    assert (_n(again["done"]), _n(again["whole"]), again["pct"]) == (60_000, 60_000, "100.0")
    assert _n(again["mine"]) == 60_000 - before


def test_a_single_epoch_npy_ingest_shows_its_exact_whole_from_the_first_line(
        redis_server, tmp_path: Path) -> None:
    """A source that knows its size up front (two .npy files: 600,000 and 400,001 tokens
    in samples of 2, so 300,000 + 200,000 records; the odd token is no record) shows the
    dataset's exact whole, 500,000, on every line from the first one: stopped (SIGTERM)
    part-way through its only epoch, before the producer has planned that epoch, its
    last line still says N of 500,000 with N the records in Redis, not "the whole is
    known once an epoch is read"."""
    import numpy as np

    from tests._ingest_util import total_len
    from trainer_client import redis_client as trainer_redis
    from trainguard.core import streams

    folder = tmp_path / "tok"
    folder.mkdir()
    np.save(folder / "a.npy", np.arange(600_000, dtype=np.int32))
    np.save(folder / "b.npy", np.arange(400_001, dtype=np.int32))
    args = [sys.executable, "-m", "trainguard", "ingest", "--redis-url", redis_server.url,
            "--dataset", "tok", "--source", str(folder), "--format", "npy",
            "--sample-len", "2", "--partitions", "4"]
    spec = streams.DatasetSpec(name="tok", partitions=4, source=str(folder), format="npy",
                               sample_len=2)
    proc = subprocess.Popen(args, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = trainer_redis.client(redis_server.url)
    try:
        while proc.poll() is None and total_len(client, spec) < 1_000:
            time.sleep(0.005)
        assert proc.poll() is None, "finished before the signal: make the source bigger"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        in_redis = total_len(client, spec)
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
    assert in_redis < 500_000, "the epoch completed: make the source bigger"
    lines = err.strip().splitlines()
    assert all(_LINE.search(line) for line in lines), err
    assert {_n(_LINE.search(line)["whole"]) for line in lines} == {500_000}
    last = _LINE.search(lines[-1])
    assert last is not None
    assert _n(last["done"]) == in_redis


def test_files_and_parquet_sources_count_their_records_before_being_read(tmp_path: Path) -> None:
    """The up-front count follows the readers' rules exactly: a ``files`` source is one
    record per file except the oversized one (a dead letter); a Parquet folder holds
    its footers' rows; a jsonl source (lines to parse) and a tokenized one say None."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainguard.core import streams
    from trainguard.ops.source_size import epoch_records_up_front

    files = tmp_path / "files"
    files.mkdir()
    for i in range(5):
        (files / f"{i}.bin").write_bytes(b"x" * 10)
    (files / "big.bin").write_bytes(b"x" * 5000)
    spec = streams.DatasetSpec(name="f", partitions=2, source=str(files), format="files",
                               max_record_bytes=1000)
    assert epoch_records_up_front(spec) == 5

    hf = tmp_path / "hf"
    hf.mkdir()
    pq.write_table(pa.table({"text": [f"t{i}" for i in range(7)]}), hf / "train-0.parquet")
    pq.write_table(pa.table({"text": [f"u{i}" for i in range(4)]}), hf / "train-1.parquet")
    (hf / "README.md").write_text("a card\n")
    assert epoch_records_up_front(streams.DatasetSpec(
        name="h", partitions=2, source=str(hf), format="hf")) == 11

    (tmp_path / "d.jsonl").write_text('{"a": 1}\n')
    assert epoch_records_up_front(streams.DatasetSpec(
        name="j", partitions=2, source=str(tmp_path / "d.jsonl"), format="jsonl")) is None
