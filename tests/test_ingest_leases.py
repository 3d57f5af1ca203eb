"""Partition leases between file producers, against real Redis (one server and a
cluster): how the partitions are shared, taken over after a producer's death, and
produced exactly once by two producers at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from ingest_service import redis_client as ingest_redis
from ingest_service.producer.leases import PartitionLeases, share
from ingest_service.producer.producer import Producer
from tests._ingest_util import expected_partitions, read_partitions, write_jsonl
from tests.servers import RedisServer
from trainguard.core import streams

P = 8


async def _holders(r, dataset: str) -> list[str | None]:  # type: ignore[no-untyped-def]
    got = [await r.get(streams.lease_key(dataset, p)) for p in range(P)]
    return [None if g is None else g.decode() for g in got]


def test_share_splits_the_partitions_among_the_live_producers() -> None:
    """Producer i of n (sorted ids) wants p % n == i: disjoint, together all."""
    live = ["b", "a", "c"]
    shares = {o: share(o, live, 8) for o in live}
    assert shares == {"a": {0, 3, 6}, "b": {1, 4, 7}, "c": {2, 5}}
    assert share("a", [], 4) == {0, 1, 2, 3}  # alone: everything


async def test_leases_split_then_take_over_after_expiry(any_redis: RedisServer) -> None:
    """A alone takes all 8 partitions. B joins: A releases B's share at its next round
    and B takes it; each then holds 4, disjoint, and every lease key names its holder.
    A stops renewing (killed): while its leases live, B takes nothing of A's; once they
    expire, B's rounds take all 8."""
    r = ingest_redis.client(any_redis.url)
    a = PartitionLeases(r, "ds", P, owner="a", lease_ms=1500)
    b = PartitionLeases(r, "ds", P, owner="b", lease_ms=1500)
    assert await a.round() == frozenset(range(P))
    assert await b.round() == frozenset()  # A holds them all
    assert await a.round() == {0, 2, 4, 6}  # released B's share
    assert await b.round() == {1, 3, 5, 7}
    assert await _holders(r, "ds") == ["a", "b"] * 4
    assert b.changed.is_set()
    b.changed.clear()
    assert await b.round() == {1, 3, 5, 7}  # A's leases still live
    assert not b.changed.is_set()
    while await b.round() != frozenset(range(P)):  # A's heartbeat and leases expire
        await asyncio.sleep(0.1)
    assert b.changed.is_set()
    assert await _holders(r, "ds") == ["b"] * P
    await r.aclose()


async def test_a_released_producer_is_taken_over_at_once(any_redis: RedisServer) -> None:
    """A clean stop gives the leases and the heartbeat back: the other producer's very
    next round takes every partition, without waiting for an expiry."""
    r = ingest_redis.client(any_redis.url)
    a = PartitionLeases(r, "ds", P, owner="a", lease_ms=60_000)
    b = PartitionLeases(r, "ds", P, owner="b", lease_ms=60_000)
    await a.round()
    await b.round()
    await a.round()
    assert await b.round() == {1, 3, 5, 7}
    await a.release()
    assert a.owned == frozenset()
    assert await b.round() == frozenset(range(P))
    assert await b.live() == ["b"]
    await r.aclose()


async def test_two_producers_share_a_dataset_exactly(any_redis: RedisServer,
                                                     tmp_path: Path) -> None:
    """Two producers on one file dataset, their leases settled before they run: each
    appends exactly the planned records of its own 4 partitions, the dataset holds
    every planned record once under its deterministic ID, and it is marked finished
    (by whichever producer found every partition done)."""
    write_jsonl(tmp_path, 4000)
    spec = streams.DatasetSpec(name="two", partitions=P, source=str(tmp_path / "*.jsonl"),
                               format="jsonl", seed=5, epochs=2, shuffle_buffer=300)
    r = ingest_redis.client(any_redis.url)
    a = Producer(r, spec, owner="a", lease_ms=60_000, batch_records=64)
    b = Producer(r, spec, owner="b", lease_ms=60_000, batch_records=64)
    for leases in (a.leases, b.leases, a.leases, b.leases):
        await leases.round()
    assert (a.leases.owned, b.leases.owned) == ({0, 2, 4, 6}, {1, 3, 5, 7})
    await asyncio.gather(a.run(), b.run())
    planned = expected_partitions(spec)
    assert read_partitions(any_redis.url, spec) == planned
    assert a.progress.records == sum(len(planned[p]) for p in (0, 2, 4, 6))
    assert b.progress.records == sum(len(planned[p]) for p in (1, 3, 5, 7))
    assert a.progress.finished and b.progress.finished
    progress = await r.hgetall(streams.progress_key("two"))
    assert progress[streams.PROGRESS_FINISHED] == b"1"
    assert {p: progress[streams.progress_end_field(p)].decode() for p in range(P)} == {
        p: planned[p][-1][0].decode() for p in range(P)}
    assert await _holders(r, "two") == [None] * P  # both gave their leases back
    await r.aclose()
