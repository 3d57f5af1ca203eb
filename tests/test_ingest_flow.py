"""Dead letters, backpressure and retention of the file producer, on a real Redis."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from redis.asyncio import Redis

from ingest_service import redis_client as ingest_redis
from ingest_service.backlog import BacklogLimits
from ingest_service.metrics import IngestMetrics
from ingest_service.producer.producer import Producer
from tests._ingest_util import expected_partitions, read_partitions, until, values, write_jsonl
from tests.servers import RedisServer
from trainguard.core import streams


def _metric(metrics: IngestMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_bad_records_go_to_dead_letters_and_the_run_goes_on(
    any_redis: RedisServer, tmp_path: Path
) -> None:
    """Broken JSON, a line over max_record_bytes and records missing a required field
    end up in the dead-letter stream with their reason and file:line; every good record
    is ingested; the counts in the stream, the metrics and the progress agree; a rerun
    after a reset of progress adds no second copy of any dead letter."""
    lines = []
    for i in range(300):
        lines.append(json.dumps({"i": i, "text": "ok"}))
        if i % 50 == 0:
            lines.append('{"i": "broken')  # undecodable
        if i % 100 == 0:
            lines.append(json.dumps({"i": -1, "text": "y" * 400}))  # oversized
        if i % 75 == 0:
            lines.append(json.dumps({"no_i": True}))  # schema: missing "i"
    (tmp_path / "src.jsonl").write_text("\n".join(lines) + "\n")
    spec = streams.DatasetSpec(
        name="dl", partitions=3, source=str(tmp_path / "src.jsonl"), max_record_bytes=300,
        options={"required_fields": ["i", "text"]},
    )
    client = ingest_redis.client(any_redis.url)
    metrics = IngestMetrics()
    producer = Producer(client, spec, metrics=metrics)
    await producer.run()
    dead = await client.xrange(streams.dlq_key("dl"))
    reasons = [f[streams.DL_REASON].decode().split(":")[0] for _, f in dead]
    assert reasons.count("undecodable") == 6
    assert reasons.count("oversized") == 3
    assert reasons.count("schema") == 4
    for reason in ("undecodable", "oversized", "schema"):
        assert _metric(metrics, "trainguard_ingest_dead_letters_total",
                       dataset="dl", reason=reason) == reasons.count(reason)
    assert producer.progress.dead_letters == len(dead) == 13
    first = dead[0][1]
    assert first[streams.DL_POS] == f"{tmp_path / 'src.jsonl'}:2".encode()
    assert first[streams.DL_PAYLOAD] == b'{"i": "broken'
    oversized = next(f for _, f in dead if f[streams.DL_REASON].startswith(b"oversized"))
    assert len(oversized[streams.DL_PAYLOAD]) == int(oversized[streams.DL_SIZE]) > 300
    good = sorted(v["i"] for p in read_partitions(any_redis.url, spec) for v in values(p))
    assert good == list(range(300))

    await client.delete(streams.progress_key("dl"))
    await Producer(client, spec).run()
    assert await client.xlen(streams.dlq_key("dl")) == 13
    await client.aclose()


async def _uncommitted(client: Redis, spec: streams.DatasetSpec, p: int, committed: bytes) -> int:
    rest = await client.xrange(streams.partition_key(spec.name, p), min=b"(" + committed)
    return len(rest)


async def test_backpressure_pauses_at_the_bound_and_resumes_on_commit(
    redis_target: RedisServer, tmp_path: Path
) -> None:
    """With a bound of 50 entries per partition and a consumer group that commits
    slowly, the producer pauses each partition at the bound (recorded in the paused set
    and the pauses metric), never has more than 50 uncommitted entries in a partition,
    resumes after every commit, and completes with exactly the planned entries."""
    write_jsonl(tmp_path, 1000)
    spec = streams.DatasetSpec(name="bp", partitions=2, source=str(tmp_path / "*.jsonl"))
    client = ingest_redis.client(redis_target.url)
    await client.sadd(streams.groups_key("bp"), "run1")
    metrics = IngestMetrics()
    limits = BacklogLimits(max_entries=50, poll_interval_s=0.01)
    producer = Producer(client, spec, limits=limits, metrics=metrics, batch_records=20)
    task = asyncio.create_task(producer.run())

    async def both_paused() -> bool:
        return await client.smembers(streams.paused_key("bp")) == {b"0", b"1"}

    await until(both_paused)
    committed = {0: b"0-0", 1: b"0-0"}
    rounds = 0
    while not task.done():
        for p in (0, 1):
            assert await _uncommitted(client, spec, p, committed[p]) <= 50
        for p in (0, 1):
            last = await client.xrevrange(streams.partition_key("bp", p), count=1)
            if last:
                # Commit half of what is there, as a consumer that lags would.
                rest = await client.xrange(streams.partition_key("bp", p), min=b"(" + committed[p])
                if rest:
                    committed[p] = rest[len(rest) // 2][0]
                    await client.hset(streams.committed_key("bp", "run1"), str(p), committed[p])
        rounds += 1
        await asyncio.sleep(0.02)
    await task
    assert rounds > 10
    assert _metric(metrics, "trainguard_ingest_pauses_total", dataset="bp") >= 2
    assert await client.smembers(streams.paused_key("bp")) == set()
    await client.aclose()
    assert read_partitions(redis_target.url, spec) == expected_partitions(spec)


async def test_a_consumer_holding_a_few_uncommitted_entries_is_never_starved(
    redis_target: RedisServer, tmp_path: Path
) -> None:
    """A trainer commits only what it trained on: here it always keeps its last 5 entries
    uncommitted and waits for more. With batches as large as the bound (50), the
    producer must append the part of a batch that fits (45) instead of waiting for room
    for the whole batch, which would wait for those 5 forever. It finishes, and no
    partition ever holds more than 50 uncommitted entries."""
    write_jsonl(tmp_path, 600)
    spec = streams.DatasetSpec(name="starve", partitions=1, source=str(tmp_path / "*.jsonl"))
    client = ingest_redis.client(redis_target.url)
    await client.sadd(streams.groups_key("starve"), "run1")
    limits = BacklogLimits(max_entries=50, poll_interval_s=0.01)
    producer = Producer(client, spec, limits=limits, batch_records=50)
    task = asyncio.create_task(producer.run())
    key = streams.partition_key("starve", 0)
    committed = b"0-0"
    deadline = asyncio.get_running_loop().time() + 60
    while not task.done():
        rest = await client.xrange(key, min=b"(" + committed)
        assert len(rest) <= 50
        assert asyncio.get_running_loop().time() < deadline, \
            f"the producer stalled with {len(rest)} uncommitted entries"
        if len(rest) > 5:
            committed = rest[-6][0]
            await client.hset(streams.committed_key("starve", "run1"), "0", committed)
        await asyncio.sleep(0.01)
    await task
    await client.aclose()
    assert read_partitions(redis_target.url, spec) == expected_partitions(spec)


async def test_retention_trims_only_below_the_smallest_floor_of_all_groups(
    redis_target: RedisServer, tmp_path: Path
) -> None:
    """Partition 0: two groups publish floors 1-40 and 1-90: trimmed to start at 1-40.
    Partition 1: only one group published a floor: not trimmed. A dataset without
    groups is not trimmed, unless max_len is set (then exactly max_len entries stay)."""
    write_jsonl(tmp_path, 400)
    spec = streams.DatasetSpec(name="ret", partitions=2, source=str(tmp_path / "*.jsonl"))
    client = ingest_redis.client(redis_target.url)
    await client.sadd(streams.groups_key("ret"), "old", "new")
    await client.hset(streams.floor_key("ret", "old"), mapping={"0": "1-40"})
    await client.hset(streams.floor_key("ret", "new"), mapping={"0": "1-90", "1": "1-150"})
    await Producer(client, spec, maintenance_interval_s=0.01).run()
    expected = expected_partitions(spec)
    parts = read_partitions(redis_target.url, spec)
    assert parts[0] == [e for e in expected[0] if streams.parse_id(e[0]) >= (1, 40)]
    assert parts[1] == expected[1]

    plain = streams.DatasetSpec(name="plain", partitions=2, source=str(tmp_path / "*.jsonl"))
    await Producer(client, plain, maintenance_interval_s=0.01).run()
    assert read_partitions(redis_target.url, plain) == expected_partitions(plain)
    capped = streams.DatasetSpec(name="capped", partitions=2, source=str(tmp_path / "*.jsonl"))
    await Producer(client, capped, limits=BacklogLimits(max_len=30)).run()
    for p, entries in enumerate(read_partitions(redis_target.url, capped)):
        assert entries == expected_partitions(capped)[p][-30:]
    await client.aclose()


async def test_deleting_a_dataset_stops_its_producer_without_recreating_it(
    any_redis: RedisServer, tmp_path: Path
) -> None:
    """A producer paused by backpressure notices its dataset was deleted, returns with
    progress.deleted, and never re-creates the deleted partitions (NOMKSTREAM)."""
    from ingest_service.datasets import delete_dataset

    write_jsonl(tmp_path, 2000)
    spec = streams.DatasetSpec(name="gone", partitions=2, source=str(tmp_path / "*.jsonl"))
    client = ingest_redis.client(any_redis.url)
    await client.sadd(streams.groups_key("gone"), "run1")
    producer = Producer(client, spec, limits=BacklogLimits(max_entries=40, poll_interval_s=0.01),
                        batch_records=20)
    task = asyncio.create_task(producer.run())

    async def paused() -> bool:
        return bool(await client.smembers(streams.paused_key("gone")))

    await until(paused)
    await delete_dataset(client, "gone")
    await asyncio.wait_for(task, 60)
    assert producer.progress.deleted and not producer.progress.finished
    for p in range(2):
        assert await client.exists(streams.partition_key("gone", p)) == 0
    assert await client.exists(streams.meta_key("gone")) == 0
    await client.aclose()


async def test_memory_stays_bounded_with_many_partitions(
    redis_target: RedisServer, tmp_path: Path
) -> None:
    """24 MiB of 8 KiB records over 256 partitions (few records each, so no partition
    fills a batch) with max_inflight_bytes=2 MiB: the producer's traced memory peak
    stays under 12 MiB, and every record is appended."""
    import tracemalloc

    import numpy as np

    np.save(tmp_path / "tok.npy", np.arange(3072 * 8192, dtype=np.uint8))
    spec = streams.DatasetSpec(name="mem", partitions=256, source=str(tmp_path / "tok.npy"),
                               format="npy", sample_len=8192, shuffle_buffer=16)
    client = ingest_redis.client(redis_target.url)
    producer = Producer(client, spec, batch_bytes=256 * 1024, max_inflight_bytes=2 * 1024 * 1024)
    tracemalloc.start()
    try:
        await producer.run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    await client.aclose()
    assert producer.progress.records == 3072
    assert peak < 12 * 1024 * 1024


def test_backlog_counts_partly_committed_runs_exactly() -> None:
    """A run of consecutive IDs, and a run of automatic IDs across milliseconds (given
    as a list), lose exactly the committed entries; a run of unknown layout is kept
    whole until it is committed entirely."""
    from ingest_service.backlog import Backlog

    b = Backlog()
    b.add((1, 0), (1, 9), 10, 1000)
    b.advance((1, 3))
    assert (b.entries, b.bytes) == (6, 600)
    b.add((5, 0), (7, 1), 3, 300, [(5, 0), (6, 0), (7, 1)])
    b.advance((6, 0))
    assert (b.entries, b.bytes) == (1, 100)
    b.add((8, 0), (9, 5), 4, 400)  # two epochs, IDs not listed
    b.advance((8, 3))
    assert (b.entries, b.bytes) == (4, 400)  # (7, 1) went; the 4-run stays whole
    b.advance((9, 5))
    assert (b.entries, b.bytes) == (0, 0)
