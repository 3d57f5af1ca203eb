"""The Redis floor (``trainguard.redisio``) is one home for what both sides know of
redis-py: the transient errors (the service's asyncio client and the trainer's retries
classify what redis-py raises alike) and the clients of a URL (sync and asyncio, one
server or a cluster, told apart by one ``is_cluster``)."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio

from ingest_service import redis_client as ingest_redis
from tests.servers import RedisCluster, RedisServer
from trainer_client import redis_client as trainer_redis
from trainer_client import redis_retry
from trainguard import redisio
from trainguard.core.process import free_port


async def test_a_lost_server_is_transient_and_a_refused_command_is_not(
        redis_server: RedisServer) -> None:
    """A server nobody answers on raises, sync and async, an error both sides retry; a
    command a live Redis refuses raises one neither retries (Redis is up)."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    sync = redis.Redis.from_url(dead, socket_connect_timeout=1)
    with pytest.raises(Exception) as lost_sync:
        sync.ping()
    sync.close()
    aclient = ingest_redis.client(dead, socket_connect_timeout=1)
    with pytest.raises(Exception) as lost_async:
        await aclient.ping()
    await aclient.aclose()
    live = redis.Redis.from_url(redis_server.url)
    with pytest.raises(redis.exceptions.ResponseError) as refused:
        live.execute_command("NOSUCHCOMMAND")
    live.close()
    for lost in (lost_sync.value, lost_async.value):
        assert isinstance(lost, redisio.TRANSIENT), lost
        assert isinstance(lost, ingest_redis.TRANSIENT) and isinstance(
            lost, redis_retry.REDIS_RETRY_ON)
    assert not isinstance(refused.value, redisio.TRANSIENT + redis_retry.REDIS_RETRY_ON)


async def test_the_sync_and_async_clients_of_a_url_are_of_one_kind(
        redis_server: RedisServer, redis_cluster: RedisCluster) -> None:
    """For the same URL the sync and the asyncio factory give the same kind of client
    (one server, or a cluster), and one ``is_cluster`` is right for all four (also as
    each part's ``redis_client.is_cluster``); the clients reach the same data: a key
    written by one is read by the other."""
    for url, cluster in ((redis_server.url, False), (redis_cluster.url, True)):
        sync = redisio.sync_client(url)
        aclient = redisio.async_client(url)
        try:
            for c in (sync, aclient):
                assert redisio.is_cluster(c) is cluster, (url, type(c))
                assert ingest_redis.is_cluster(c) is cluster, (url, type(c))
                assert trainer_redis.is_cluster(c) is cluster, (url, type(c))
            assert isinstance(sync, redis.Redis) is not cluster
            assert isinstance(aclient, redis.asyncio.Redis) is not cluster
            for n in range(8):  # keys in several slots: on a cluster, several masters
                sync.set(f"k{n}", f"sync-{n}")
                assert await aclient.get(f"k{n}") == f"sync-{n}".encode()
                await aclient.set(f"a{n}", f"async-{n}")
                assert sync.get(f"a{n}") == f"async-{n}".encode()
        finally:
            sync.close()
            await aclient.aclose()
