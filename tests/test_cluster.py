"""trainguard on a Redis Cluster (3 masters, 3 replicas, real redis-server processes):
the URL that selects it, and what survives a master's kill -9 with its replica
promoted. The single/cluster legs of the ingest, consume, session and admin tests are
in their own files (the ``any_redis`` fixture)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer

from ingest_service import redis_client as ingest_redis
from ingest_service.app import create_app
from ingest_service.config import IngestConfig
from ingest_service.datasets import create_dataset
from ingest_service.producer import Producer
from tests._ingest_util import expected_partitions, read_partitions, write_jsonl
from tests.servers import RedisCluster
from trainguard.core import redis_url, streams


def test_url_selects_one_server_or_a_cluster() -> None:
    """redis:// is one server, passed to redis-py as is; redis+cluster:// lists start
    nodes (credentials and TLS read from it); the asyncio client follows the mode (the
    sync one connects when made: the session tests run it on both)."""
    one = redis_url.parse("redis://10.0.0.1:6380/2")
    assert (one.cluster, one.url) == (False, "redis://10.0.0.1:6380/2")
    many = redis_url.parse("rediss+cluster://u:p%40ss@a.example:7000,10.0.0.2,b:7002/")
    assert many.cluster and many.ssl
    assert many.nodes == (("a.example", 7000), ("10.0.0.2", 6379), ("b", 7002))
    assert (many.username, many.password) == ("u", "p@ss")
    assert not ingest_redis.is_cluster(ingest_redis.client("redis://127.0.0.1:1/0"))
    assert ingest_redis.is_cluster(ingest_redis.client("redis+cluster://127.0.0.1:1"))


@pytest.mark.parametrize("url, says", [
    ("redis+cluster://h:1/3", "only database 0"),
    ("redis+cluster://h:1,:2", "not host:port"),
    ("redis+cluster://h:port", "not host:port"),
    ("127.0.0.1:6379", "has no scheme"),
])
def test_bad_urls_say_what_was_expected(url: str, says: str) -> None:
    with pytest.raises(redis_url.RedisUrlError, match=says):
        redis_url.parse(url)


async def test_acknowledged_pushes_survive_a_master_kill(
    redis_cluster_factory: Callable[[], RedisCluster],
) -> None:
    """8 producers push numbered batches to a 6-partition push dataset and retry every
    batch until the service acknowledges it (200). Midway, the master holding most
    partitions is killed with SIGKILL and its replica promoted. Afterwards every
    batch was acknowledged, and every record of every acknowledged batch is in the
    dataset exactly once (a batch the old master took but never replicated was not
    acknowledged, so its producer sent it again; one it did replicate is refused as a
    repeat by its seq mark, which replicated with it)."""
    cluster = redis_cluster_factory()
    r = ingest_redis.client(cluster.url)
    P, producers, batches = 6, 8, 25
    await create_dataset(r, streams.DatasetSpec(name="px", partitions=P, format="push"))
    config = IngestConfig(redis_url=cluster.url, produce=False, push_wait_ms=500)
    acked: list[tuple[int, int]] = []
    statuses: Counter[int] = Counter()
    kill_at = producers * batches // 3

    async with TestClient(TestServer(create_app(config), host="127.0.0.1")) as client:

        async def producer(k: int) -> None:
            for seq in range(batches):
                body = msgpack.packb([{"k": k, "seq": seq, "i": i} for i in range(3)])
                while True:
                    resp = await client.post(
                        f"/v1/datasets/px/records?producer_id=pr{k}&seq={seq}", data=body,
                        headers={"Content-Type": "application/msgpack"},
                    )
                    statuses[resp.status] += 1
                    if resp.status == 200:
                        acked.append((k, seq))
                        break
                    assert resp.status in (500, 503), await resp.text()
                    await asyncio.sleep(0.05)

        async def killer() -> None:
            while len(acked) < kill_at:
                await asyncio.sleep(0.01)
            owners = Counter(cluster.master_of(streams.partition_key("px", p)).port for p in range(P))
            victim = owners.most_common(1)[0][0]
            key = next(streams.partition_key("px", p) for p in range(P)
                       if cluster.master_of(streams.partition_key("px", p)).port == victim)
            await asyncio.to_thread(cluster.kill_master, key)

        await asyncio.gather(killer(), *(producer(k) for k in range(producers)))

    check = ingest_redis.client(cluster.url)
    seen: Counter[tuple[Any, ...]] = Counter()
    for p in range(P):
        for _, fields in await check.xrange(streams.partition_key("px", p)):
            v = streams.decode_record(fields)
            seen[(v["k"], v["seq"], v["i"])] += 1
    await check.aclose()
    await r.aclose()
    assert sorted(acked) == [(k, s) for k in range(producers) for s in range(batches)]
    assert seen == Counter({(k, s, i): 1 for k in range(producers) for s in range(batches)
                            for i in range(3)})
    assert statuses[200] == producers * batches


async def test_file_producer_replays_what_a_failover_lost(
    redis_cluster_factory: Callable[[], RedisCluster], tmp_path: Path,
) -> None:
    """A file dataset is produced onto the cluster while the master of partition 0 is
    killed with SIGKILL, its replica promoted without the master's last half second of
    appends (the replication link was cut meanwhile), while the progress hash, on
    another master, already counts the first epoch done. The
    producer's links break, it syncs again, finds partitions that end before what it
    wrote and appends the rest under the same deterministic IDs: at the end every
    partition holds exactly what the planner says, once, in order."""
    cluster = redis_cluster_factory()
    write_jsonl(tmp_path / "src", 8_000, files=3)
    # One partition: every append goes to the master that is killed, up to the end.
    spec = streams.DatasetSpec(name="fx", partitions=1, source=str(tmp_path / "src" / "*.jsonl"),
                               epochs=2)
    client = ingest_redis.client(cluster.url)
    # Small batches: slow enough that the kill lands mid-run.
    producer = Producer(client, spec, batch_records=16)
    run = asyncio.create_task(producer.run())
    key = streams.partition_key("fx", 0)

    async def until_records(n: int) -> None:
        while producer.progress.records < n:
            assert not run.done(), "the producer finished before the kill"
            await asyncio.sleep(0.005)

    await until_records(9_000)  # in the second epoch
    await asyncio.to_thread(cluster.cut_replication, key)
    await until_records(9_500)  # appends only the master holds
    await asyncio.to_thread(cluster.kill_master, key)
    await run
    await client.aclose()
    assert producer.progress.finished
    assert producer.progress.redis_losses >= 1  # it did see a partition end early
    assert read_partitions(cluster.url, spec) == expected_partitions(spec)
