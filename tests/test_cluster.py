"""trainguard on a Redis Cluster (3 masters, 3 replicas, real redis-server processes):
the URL that selects it, and what survives a master's kill -9 with its replica
promoted. The single/cluster legs of the ingest, consume, session and admin tests are
in their own files (the ``any_redis`` fixture)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ingest_service import redis_client as ingest_redis
from ingest_service import seek
from ingest_service.datasets import create_dataset
from ingest_service.errors import Refused
from ingest_service.producer.producer import Producer
from ingest_service.service.app import create_app
from ingest_service.service.auth import PushTokens
from ingest_service.service.config import IngestConfig
from tests._ingest_util import expected_partitions, read_partitions, write_jsonl
from tests.admin_helpers import ThreadedServer, make_dataset, make_group
from tests.servers import RedisCluster
from trainguard.core import redis_url, streams
from trainguard.push import Producer as PushProducer


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


def test_acknowledged_pushes_survive_a_master_kill(
    redis_cluster_factory: Callable[[], RedisCluster],
) -> None:
    """8 producers (``trainguard.push.Producer``, each with its own producer token,
    through the authenticated push route) push numbered batches to a 6-partition push
    dataset; each send retries until the service acknowledges the batch (200).
    Midway, the master holding most partitions is killed with SIGKILL and its replica
    promoted. Afterwards every batch was acknowledged, and every record of every
    acknowledged batch is in the dataset exactly once (a batch the old master took but
    never replicated was not acknowledged, so its producer sent it again; one it did
    replicate is answered as in by its seq mark, which replicated with it)."""
    cluster = redis_cluster_factory()
    P, producers, batches = 6, 8, 25
    tokens = {k: f"producer-token-{k}-0123456789" for k in range(producers)}

    async def create() -> None:
        r = ingest_redis.client(cluster.url)
        await create_dataset(r, streams.DatasetSpec(name="px", partitions=P, format="push"))
        await r.aclose()

    asyncio.run(create())
    config = IngestConfig(
        redis_url=cluster.url, produce=False, push_wait_ms=500,
        push_tokens=PushTokens.parse(";".join(f"{t}:px:pr{k}" for k, t in tokens.items())),
    )
    server = ThreadedServer(create_app(config)).start()
    acked: list[tuple[int, int]] = []
    lock = threading.Lock()
    kill_at = producers * batches // 3
    killed_after = -1

    def produce(k: int) -> None:
        with PushProducer(server.url, "px", f"pr{k}", token=tokens[k], max_attempts=200,
                          max_backoff_s=0.5) as producer:
            for seq in range(batches):
                reply = producer.send([{"k": k, "seq": seq, "i": i} for i in range(3)])
                assert reply.seq == seq
                with lock:
                    acked.append((k, seq))

    def kill() -> None:
        nonlocal killed_after
        while len(acked) < kill_at:
            time.sleep(0.01)
        owners = Counter(cluster.master_of(streams.partition_key("px", p)).port for p in range(P))
        victim = owners.most_common(1)[0][0]
        key = next(streams.partition_key("px", p) for p in range(P)
                   if cluster.master_of(streams.partition_key("px", p)).port == victim)
        killed_after = len(acked)
        cluster.kill_master(key)

    try:
        with ThreadPoolExecutor(producers + 1) as pool:
            for f in [pool.submit(kill), *(pool.submit(produce, k) for k in range(producers))]:
                f.result()
    finally:
        server.stop()

    async def read() -> Counter[tuple[Any, ...]]:
        check = ingest_redis.client(cluster.url)
        seen: Counter[tuple[Any, ...]] = Counter()
        for p in range(P):
            for _, fields in await check.xrange(streams.partition_key("px", p)):
                v = streams.decode_record(fields)
                seen[(v["k"], v["seq"], v["i"])] += 1
        await check.aclose()
        return seen

    seen = asyncio.run(read())
    assert 0 <= killed_after < producers * batches  # the kill landed mid-run
    assert sorted(acked) == [(k, s) for k in range(producers) for s in range(batches)]
    assert seen == Counter({(k, s, i): 1 for k in range(producers) for s in range(batches)
                            for i in range(3)})


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


async def test_cluster_seek_racing_a_restore_ends_as_the_restore(
    redis_cluster: RedisCluster, tmp_path: Path,
) -> None:
    """On a cluster a seek moves partition by partition (no transaction spans slots).
    A trainer's restore that takes a new fencing generation between the seek's checks
    and its move: here partition 2's fence is already at the restore's generation when
    the seek's apply step runs under the generation it read (0). The seek is refused
    ("fenced") naming the fenced partition; the others did move; the restore then moves
    every partition to its checkpoint (none: the start) under its generation, so no
    partition keeps the seek's position. A later seek of the older generation
    changes nothing."""
    import torch

    from trainer_client import TrainingSession

    r = ingest_redis.client(redis_cluster.url)
    P = 6
    await make_dataset(r, partitions=P, per_partition=5)
    await make_group(r, "toy", "run1", P)
    keys = [streams.partition_key("toy", p) for p in range(P)]
    assert len({redis_cluster.master_of(k).port for k in keys}) > 1  # spread over masters
    targets = dict.fromkeys(range(P), "1-3")
    await r.set(streams.fence_key("toy", 2, "run1"), 1)

    async def delivered() -> list[str]:
        return [(await r.xinfo_groups(k))[0]["last-delivered-id"].decode() for k in keys]

    with pytest.raises(Refused, match=r"\[2\] were fenced") as refused:
        await seek.apply_per_slot(r, "toy", "run1", 0, targets)
    assert refused.value.code == "fenced"
    assert await delivered() == ["1-3", "1-3", "0-0", "1-3", "1-3", "1-3"]

    session = TrainingSession(redis_cluster.url, dataset="toy", run="run1",
                              store=f"file://{tmp_path}/ckpt")
    session.restore({"w": torch.zeros(2)})
    assert session.generation >= 1
    session.close()
    assert await delivered() == ["0-0"] * P
    with pytest.raises(Refused):
        await seek.apply_per_slot(r, "toy", "run1", 0, targets)
    assert await delivered() == ["0-0"] * P
    await r.aclose()


async def test_concurrent_first_commands_of_fresh_clients_all_succeed(
    redis_cluster: RedisCluster,
) -> None:
    """On a fresh asyncio cluster client, ten concurrent first commands (the creates of
    one dataset with ten seeds) each reach their key's master: in every one of 20
    rounds exactly one create wins and the nine others are refused as conflicts, and no
    call fails otherwise (redis-py 8.1 alone routes a command started before the slot
    map is read to a random node; five MOVED make it close every connection, those of
    the other nine included: AttributeError, ConnectionError). The masters count the
    MOVED they answered: none is answered during the rounds."""
    import redis

    from ingest_service.errors import DatasetExistsError

    def moved_answered() -> int:
        total = 0
        for node in redis_cluster.nodes:
            one = redis.Redis(port=node.port, socket_timeout=5)
            try:
                total += int(one.info("errorstats").get("errorstat_MOVED", {}).get("count", 0))
            finally:
                one.close()
        return total

    moved_before = moved_answered()
    failures: list[tuple[int, BaseException]] = []
    for round_ in range(20):
        client = ingest_redis.client(redis_cluster.url)
        specs = [streams.DatasetSpec(name=f"first{round_}", source="memory://a", seed=s)
                 for s in range(10)]
        results = await asyncio.gather(*(create_dataset(client, s) for s in specs),
                                       return_exceptions=True)
        await client.aclose()
        failures += [(round_, r) for r in results
                     if isinstance(r, BaseException) and not isinstance(r, DatasetExistsError)]
        winners = [r for r in results if isinstance(r, streams.DatasetSpec)]
        if not failures:
            assert len(winners) == 1, f"round {round_}: {results}"
    assert failures == []
    assert moved_answered() - moved_before == 0
