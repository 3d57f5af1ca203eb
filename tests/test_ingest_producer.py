"""The file-source producer: deterministic partitions, exactly-once across crashes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ingest_service import redis_client as ingest_redis
from ingest_service.producer.producer import Producer
from tests._ingest_util import (
    expected_partitions,
    kill_at_random_points,
    read_partitions,
    values,
    write_jsonl,
)
from tests.servers import RedisServer
from trainguard.core import streams


def _spec(name: str, source: Path, **kw: object) -> streams.DatasetSpec:
    base: dict[str, object] = dict(
        name=name, partitions=8, source=str(source / "*.jsonl"), format="jsonl",
        seed=7, epochs=1, shuffle_buffer=500,
    )
    base.update(kw)
    return streams.DatasetSpec(**base)  # type: ignore[arg-type]


async def test_same_source_and_seed_give_identical_partitions(
    any_redis: RedisServer, tmp_path: Path
) -> None:
    """Two datasets of the same source and seed hold the same IDs and bytes in every
    partition; another seed holds the same multiset of records in another order."""
    write_jsonl(tmp_path, 3000, files=3)
    client = ingest_redis.client(any_redis.url)
    a, b = _spec("a", tmp_path, epochs=2), _spec("b", tmp_path, epochs=2)
    c = _spec("c", tmp_path, epochs=2, seed=8)
    for spec in (a, b, c):
        await Producer(client, spec).run()
    await client.aclose()
    pa, pb, pc = (read_partitions(any_redis.url, s) for s in (a, b, c))
    assert pa == pb
    assert sum(len(x) for x in pa) == 6000
    flat = lambda parts: [json.dumps(v, sort_keys=True) for p in parts for v in values(p)]  # noqa: E731
    assert Counter(flat(pa)) == Counter(flat(pc))
    assert flat(pa) != flat(pc)
    # Each epoch holds every record once, and the two epochs are shuffled differently.
    epoch_of = lambda parts, e: [  # noqa: E731
        v["i"] for p in parts for (i, f), v in zip(p, values(p)) if i.startswith(f"{e}-".encode())
    ]
    assert sorted(epoch_of(pa, 1)) == sorted(epoch_of(pa, 2)) == list(range(3000))
    assert epoch_of(pa, 1) != epoch_of(pa, 2)


async def test_rerun_of_a_finished_dataset_appends_nothing(
    redis_target: RedisServer, tmp_path: Path
) -> None:
    """A finished dataset is recognised (progress hash) and not produced again; its
    ``end:<p>`` fields name each partition's last ID."""
    write_jsonl(tmp_path, 500)
    spec = _spec("d", tmp_path)
    client = ingest_redis.client(redis_target.url)
    await Producer(client, spec).run()
    again = Producer(client, spec)
    await again.run()
    progress = await client.hgetall(streams.progress_key("d"))
    await client.aclose()
    assert again.progress.records == 0 and again.progress.finished
    parts = read_partitions(redis_target.url, spec)
    assert parts == expected_partitions(spec)
    for p, entries in enumerate(parts):
        assert progress[streams.progress_end_field(p)] == entries[-1][0]


def _check_exactly_once(url: str, spec: streams.DatasetSpec, total: int) -> None:
    parts = read_partitions(url, spec)
    assert parts == expected_partitions(spec)  # same IDs, bytes and order as planned
    seen = Counter(v["i"] for p in parts for v in values(p))
    assert sorted(seen) == list(range(total))
    assert set(seen.values()) == {spec.epochs}


def test_kill_9_producer_ten_times_every_record_once_in_order(
    redis_target: RedisServer, tmp_path: Path
) -> None:
    """SIGKILL the producer process at 10 random points of a 50,000-record run and
    restart it each time: every record ends up exactly once, in planned order."""
    total = 50_000
    write_jsonl(tmp_path, total, files=4)
    spec = _spec("k", tmp_path)
    landed = kill_at_random_points(redis_target.url, spec, total, 10)
    assert landed >= 8  # the kills really hit running producers
    _check_exactly_once(redis_target.url, spec, total)


@pytest.mark.chaos
def test_kill_9_producer_fifty_times_over_two_epochs(
    redis_target: RedisServer, tmp_path: Path
) -> None:
    """50 kills over 2 epochs of 50,000 records on 16 partitions: every record once per
    epoch, in planned order."""
    total = 50_000
    write_jsonl(tmp_path, total, files=5)
    spec = _spec("k50", tmp_path, partitions=16, epochs=2)
    landed = kill_at_random_points(redis_target.url, spec, 2 * total, 50)
    assert landed >= 40
    _check_exactly_once(redis_target.url, spec, total)



async def test_first_sync_ignores_floors_published_before_it(
    any_redis: RedisServer, tmp_path: Path
) -> None:
    """A retention floor is a refill point only for a stream this producer saw. A
    2-partition dataset whose producer stopped, then partition 1's stream was lost
    (on a cluster the floor hash lives on another master than the stream, and
    survives its failover), while a group's floor (1-99 on both) is published. A fresh
    producer's maintenance pass reads that floor while the first sync still pages
    through partition 0: it must not make partition 1 begin after the floor. The
    producer appends partition 1's whole plan (what it appends does not depend on
    which task ran first) and retention then trims below the floor, keeping the floor
    entry itself, as it promises."""
    write_jsonl(tmp_path, 6000)
    spec = _spec("fl", tmp_path, partitions=2, shuffle_buffer=0)
    client = ingest_redis.client(any_redis.url)
    await Producer(client, spec).run()
    await client.delete(streams.partition_key("fl", 1), streams.progress_key("fl"))
    await client.sadd(streams.groups_key("fl"), "g")
    await client.hset(streams.floor_key("fl", "g"), mapping={"0": "1-99", "1": "1-99"})
    await client.hset(streams.committed_key("fl", "g"), mapping={"0": "1-99", "1": "1-99"})
    producer = Producer(client, spec, maintenance_interval_s=0.001)
    await producer.run()
    info = await client.xinfo_stream(streams.partition_key("fl", 1))
    await client.aclose()
    planned = expected_partitions(spec)
    assert producer.progress.records == len(planned[1]) == info["entries-added"] == 3000
    assert read_partitions(any_redis.url, spec) == [planned[0][99:], planned[1][99:]]
