"""The transient Redis errors have one home (``trainguard.redisio``): the service's
asyncio client and the trainer's retries classify what redis-py raises alike."""

from __future__ import annotations

import pytest
import redis

from ingest_service import redis_client as ingest_redis
from tests.servers import RedisServer
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
