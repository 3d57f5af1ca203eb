"""trainguard.push.Producer against the real service and a real Redis: exactly once
through a producer restart, a Redis kill -9 and restart, and refused batches."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest
from redis import Redis

from ingest_service.datasets import create_dataset
from ingest_service.push.ingest import choose_partition
from ingest_service.service.app import create_app
from ingest_service.service.auth import PushTokens
from ingest_service.service.config import IngestConfig
from tests.admin_helpers import ThreadedServer
from tests.servers import RedisServer
from trainguard.core import streams
from trainguard.push import Producer, PushRejectedError

TOKEN = "client-test-token-0123456"


@pytest.fixture
def durable_redis(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_factory(persistence="always")


@pytest.fixture
def served(durable_redis: RedisServer) -> Iterator[str]:
    async def setup() -> None:
        from redis.asyncio import Redis as AsyncRedis

        r = AsyncRedis.from_url(durable_redis.url)
        await create_dataset(r, streams.DatasetSpec(name="rl", partitions=2, format="push"))
        await r.aclose()

    asyncio.run(setup())
    config = IngestConfig(redis_url=durable_redis.url, produce=False,
                          push_tokens=PushTokens.parse(f"{TOKEN}:rl:w-*"))
    server = ThreadedServer(create_app(config)).start()
    try:
        yield server.url
    finally:
        server.stop()


def _values(url: str, producer: str) -> list[int]:
    r = Redis.from_url(url)
    try:
        key = streams.partition_key("rl", choose_partition(producer, 2))
        return [streams.decode_record(f)["n"] for _, f in r.xrange(key)
                if streams.decode_record(f)["w"] == producer]
    finally:
        r.close()


def test_producer_sends_exactly_once_through_restarts(served: str,
                                                      durable_redis: RedisServer) -> None:
    """A producer sends 10 batches, a new Producer for the same producer_id resumes at
    seq 10 (nothing resent), Redis is killed -9 and restarted while batches are sent
    (the client retries through the 503s), and every record is in the stream once,
    in order."""
    with Producer(served, "rl", "w-1", token=TOKEN, backoff_s=0.02) as p:
        for b in range(10):
            p.send([{"w": "w-1", "n": b * 3 + i} for i in range(3)])
    with Producer(served, "rl", "w-1", token=TOKEN, backoff_s=0.02) as p:
        assert p.resume() == 10
        durable_redis.kill()
        restarter = threading.Timer(0.5, durable_redis.restart)
        restarter.start()
        for b in range(10, 20):
            p.send([{"w": "w-1", "n": b * 3 + i} for i in range(3)])
        restarter.join()
    assert _values(durable_redis.url, "w-1") == list(range(60))


def test_producer_refused_for_good_raises(served: str, durable_redis: RedisServer) -> None:
    """A producer_id outside the token's scope is refused with 403, raised at once
    (not retried), and nothing is stored."""
    with Producer(served, "rl", "intruder", token=TOKEN) as p, \
            pytest.raises(PushRejectedError) as caught:
        p.send([{"w": "intruder", "n": 0}])
    assert caught.value.status == 403
    assert _values(durable_redis.url, "intruder") == []
