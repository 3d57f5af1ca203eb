"""Dataset registry and the ``trainguard ingest`` command, on a real Redis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ingest_service import redis_client as ingest_redis
from ingest_service.datasets import create_dataset, delete_dataset, describe_dataset, list_datasets
from ingest_service.errors import DatasetExistsError, DatasetNotFoundError, IngestError
from tests._ingest_util import expected_partitions, read_partitions, write_jsonl
from tests.servers import RedisServer
from trainer_client import redis_client as trainer_redis
from trainguard.core import streams

ROOT = Path(__file__).resolve().parent.parent


async def test_create_is_idempotent_and_refuses_other_settings(redis_target: RedisServer) -> None:
    """Creating the same spec twice returns it; other settings raise DatasetExistsError
    naming each differing field; describe/list/delete see exactly what was created."""
    client = ingest_redis.client(redis_target.url)
    spec = streams.DatasetSpec(name="ds", partitions=4, source="memory://a.jsonl", seed=1)
    assert await create_dataset(client, spec) == spec
    assert await create_dataset(client, spec) == spec
    other = streams.DatasetSpec(name="ds", partitions=8, source="memory://a.jsonl", seed=2)
    with pytest.raises(DatasetExistsError) as info:
        await create_dataset(client, other)
    assert set(info.value.differences) == {"partitions", "seed"}
    assert "partitions" in str(info.value) and "seed" in str(info.value)
    assert isinstance(info.value, IngestError) and isinstance(info.value, FileExistsError)
    assert await describe_dataset(client, "ds") == spec
    assert await list_datasets(client) == ["ds"]
    await client.xadd(streams.partition_key("ds", 3), {b"d": b"x"}, id="1-0")
    await delete_dataset(client, "ds")
    assert await list_datasets(client) == []
    assert await client.exists(streams.partition_key("ds", 3)) == 0
    with pytest.raises(DatasetNotFoundError, match="not registered"):
        await describe_dataset(client, "ds")
    await client.aclose()


async def test_concurrent_creates_of_different_specs_one_wins(redis_target: RedisServer) -> None:
    """Ten concurrent creates with different seeds: exactly one succeeds, the stored spec
    is that one, the other nine are refused."""
    client = ingest_redis.client(redis_target.url)
    specs = [streams.DatasetSpec(name="race", source="memory://a", seed=s) for s in range(10)]
    results = await asyncio.gather(*(create_dataset(client, s) for s in specs),
                                   return_exceptions=True)
    winners = [r for r in results if isinstance(r, streams.DatasetSpec)]
    assert len(winners) == 1
    assert all(isinstance(r, DatasetExistsError) for r in results if r not in winners)
    assert await describe_dataset(client, "race") == winners[0]
    await client.aclose()


def _cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": url}
    return subprocess.run([sys.executable, "-m", "trainguard", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_trainguard_ingest_creates_produces_and_refuses_a_conflict(
    redis_target: RedisServer, tmp_path: Path
) -> None:
    """``trainguard ingest`` registers the dataset from its flags, produces it completely
    (exit 0, a progress line naming the dataset), and a second call with another seed
    exits 4 (refused) naming the field."""
    write_jsonl(tmp_path, 300)
    args = ["ingest", "--dataset", "cli", "--source", str(tmp_path / "*.jsonl"),
            "--partitions", "3", "--seed", "9", "--epochs", "2"]
    done = _cli(*args, url=redis_target.url)
    assert done.returncode == 0, done.stderr
    assert "cli: done epoch 2/2" in done.stderr and "600 records" in done.stderr
    spec = streams.DatasetSpec(name="cli", partitions=3, source=str(tmp_path / "*.jsonl"),
                               seed=9, epochs=2)
    assert read_partitions(redis_target.url, spec) == expected_partitions(spec)
    conflict = _cli(*args[:-4], "--seed", "10", "--epochs", "2", url=redis_target.url)
    assert conflict.returncode == 4 and "seed" in conflict.stderr


def test_trainguard_ingest_stops_on_sigterm_with_exit_0_and_resumes(
    redis_target: RedisServer, tmp_path: Path
) -> None:
    """SIGTERM during ``trainguard ingest`` ends it with exit 0 after the batches in
    flight; running it again completes the dataset exactly as planned."""
    import signal
    import time

    from tests._ingest_util import total_len

    write_jsonl(tmp_path, 50_000, files=2)
    args = ["ingest", "--dataset", "term", "--source", str(tmp_path / "*.jsonl"),
            "--partitions", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": redis_target.url}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    spec = streams.DatasetSpec(name="term", partitions=4, source=str(tmp_path / "*.jsonl"))
    client = trainer_redis.client(redis_target.url)
    try:
        while proc.poll() is None and total_len(client, spec) < 2000:
            time.sleep(0.005)
        assert proc.poll() is None, "finished before the signal: make the source bigger"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "term: stopped" in err
        assert 0 < total_len(client, spec) < 50_000
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
    again = _cli(*args, url=redis_target.url)
    assert again.returncode == 0, again.stderr
    assert read_partitions(redis_target.url, spec) == expected_partitions(spec)
