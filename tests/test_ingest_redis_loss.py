"""Redis dies under a running producer: the producer notices and completes exactly."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from redis.asyncio import Redis

from ingest_service.datasets import describe_dataset
from ingest_service.producer.producer import Producer
from tests._ingest_util import expected_partitions, read_partitions, until, write_jsonl
from tests.servers import RedisServer
from trainguard.core import streams


def _spec(source: Path) -> streams.DatasetSpec:
    return streams.DatasetSpec(
        name="loss", partitions=4, source=str(source / "*.jsonl"), format="jsonl",
        seed=3, epochs=2, shuffle_buffer=256,
    )


async def _total(client: Redis, spec: streams.DatasetSpec) -> int:
    n = 0
    for p in range(spec.partitions):
        n += await client.xlen(streams.partition_key(spec.name, p))
    return n


async def test_redis_restarted_empty_producer_refills_from_floor(
    redis_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """Redis without persistence is SIGKILLed mid-run and comes back empty: the producer
    notices, re-registers the dataset, refills partition 0 from the retention floor it
    last saw (a consumer group kept 1-100) and the others from the start, and finishes
    with every partition holding exactly the planned entries (above the floor for p0)."""
    write_jsonl(tmp_path, 20_000, files=2)
    spec = _spec(tmp_path)
    server = redis_factory(persistence="none")
    client = Redis.from_url(server.url)
    await client.sadd(streams.groups_key(spec.name), "run1")
    await client.hset(streams.floor_key(spec.name, "run1"), mapping={"0": "1-100"})
    producer = Producer(client, spec, batch_records=64, maintenance_interval_s=0.02)
    task = asyncio.create_task(producer.run())
    await until(lambda: _seen_floor_and_progress(producer, client, spec))
    assert not task.done()
    server.restart()  # SIGKILL, then start again: no persistence, so empty
    await asyncio.wait_for(task, 120)
    assert producer.progress.redis_losses >= 1
    assert (await describe_dataset(client, spec.name)) == spec
    await client.aclose()
    parts = read_partitions(server.url, spec)
    expected = expected_partitions(spec)
    assert parts[0] == [e for e in expected[0] if streams.parse_id(e[0]) > (1, 100)]
    assert parts[1:] == expected[1:]


async def _seen_floor_and_progress(
    producer: Producer, client: Redis, spec: streams.DatasetSpec
) -> bool:
    return producer.floors.get(0) == (1, 100) and await _total(client, spec) >= 12_000


async def test_redis_with_aof_always_loses_nothing_acknowledged(
    redis_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """Redis with appendfsync always is SIGKILLed mid-run and restarted on its data: the
    producer finds every partition where its acknowledged appends left it (no loss
    detected), continues, and the result is exactly the planned entries."""
    write_jsonl(tmp_path, 20_000, files=2)
    spec = _spec(tmp_path)
    server = redis_factory(persistence="always")
    client = Redis.from_url(server.url)
    producer = Producer(client, spec, batch_records=64)
    task = asyncio.create_task(producer.run())
    await until(lambda: _at_least(client, spec, 12_000))
    assert not task.done()
    server.restart()
    await asyncio.wait_for(task, 120)
    await client.aclose()
    assert producer.progress.redis_losses == 0
    assert read_partitions(server.url, spec) == expected_partitions(spec)


async def _at_least(client: Redis, spec: streams.DatasetSpec, n: int) -> bool:
    return await _total(client, spec) >= n


@pytest.mark.chaos
@pytest.mark.parametrize("persistence", ["always", "none"])
async def test_redis_killed_repeatedly_producer_still_exact(
    redis_factory: Callable[..., RedisServer], tmp_path: Path, persistence: str
) -> None:
    """Redis SIGKILLed and restarted 8 times during a 2-epoch run of 50,000 records:
    with AOF always nothing acknowledged is ever lost (no loss detected); without
    persistence the producer refills each time; either way the end result is exactly
    the planned entries."""
    write_jsonl(tmp_path, 50_000, files=2)
    spec = _spec(tmp_path)
    server = redis_factory(persistence=persistence)
    client = Redis.from_url(server.url)
    producer = Producer(client, spec, batch_records=128)
    task = asyncio.create_task(producer.run())
    for k in range(1, 9):
        await until(lambda k=k: _progress_at_least(producer, task, k * 9_000))  # type: ignore[misc]
        if task.done():
            break
        server.restart()
    await asyncio.wait_for(task, 240)
    await client.aclose()
    if persistence == "always":
        assert producer.progress.redis_losses == 0
    else:
        assert producer.progress.redis_losses >= 1
    assert read_partitions(server.url, spec) == expected_partitions(spec)


async def _progress_at_least(producer: Producer, task: asyncio.Task[None], n: int) -> bool:
    return task.done() or producer.progress.records >= n


async def test_redis_that_stops_answering_times_out_and_resumes_exactly(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis frozen (SIGSTOP) while batches are in flight: the writers' calls time out
    (the client's socket timeout), the producer syncs again once Redis answers
    (SIGCONT), and it finishes with exactly the planned partitions: the batches cut off
    mid-send or mid-reply are neither lost nor doubled."""
    write_jsonl(tmp_path, 40_000, files=2)
    spec = _spec(tmp_path)
    client = Redis.from_url(redis_server.url, socket_timeout=0.5)
    producer = Producer(client, spec, batch_records=64)
    task = asyncio.create_task(producer.run())
    probe = Redis.from_url(redis_server.url)
    await until(lambda: _has_records(probe, spec))
    await probe.aclose()
    assert redis_server.pid is not None
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(1.5)
        assert not task.done()
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    await asyncio.wait_for(task, 120)
    await client.aclose()
    assert "syncing again" in caplog.text  # a timeout was met, not waited out
    assert read_partitions(redis_server.url, spec) == expected_partitions(spec)


async def _has_records(client: Redis, spec: streams.DatasetSpec) -> bool:
    return await _total(client, spec) > 0
