"""The service's asyncio Redis clients, one server or a Redis Cluster as the URL says:
the client of a URL is the Redis floor's (:func:`trainguard.redisio.async_client`);
here what only the service does with one, the pool of the server holding a key."""

from __future__ import annotations

import contextlib
from typing import Any, cast

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from trainguard import redisio

__all__ = ["FAILOVER_ERRORS", "TRANSIENT", "client", "is_cluster", "node_name", "pool_for", "refresh"]


# The transient errors, the client of a URL and the cluster test are the Redis
# floor's, one home for every part; these names stay for the service's modules.
FAILOVER_ERRORS, TRANSIENT = redisio.FAILOVER_ERRORS, redisio.TRANSIENT
client = redisio.async_client
is_cluster = redisio.is_cluster


class _NodePool:
    """The connection-pool calls the hot path makes (``get_connection``, ``release``,
    ``connection_kwargs``), served by one cluster node's own connections."""

    def __init__(self, node: Any) -> None:
        self._node = node
        self.connection_kwargs = node.connection_kwargs

    async def get_connection(self) -> Any:
        conn = self._node.acquire_connection()
        try:
            await conn.connect()
        except BaseException:
            self._node.release(conn)
            raise
        return conn

    async def release(self, conn: Any) -> None:
        self._node.release(conn)


async def pool_for(c: Redis, key: str) -> Any:
    """The pool whose connections reach the server holding ``key``: the client's own
    pool on one server, the master of ``key``'s slot on a cluster (looked up now: after
    a failover the next call finds the new master)."""
    if not is_cluster(c):
        return c.connection_pool
    cluster: Any = c
    await cluster.initialize()
    node = cluster.get_node_from_key(key)
    if node is None:
        raise RedisConnectionError(f"no master serves the slot of {key!r} now (a failover?)")
    return _NodePool(node)


async def refresh(c: Redis) -> None:
    """After a failover error on a connection of our own (``pool_for``): make a
    cluster client read the slots again, so the next ``pool_for`` finds the new
    master. redis-py does this itself only for the commands it sends."""
    if is_cluster(c):
        with contextlib.suppress(*TRANSIENT, redis_errors.RedisClusterException):
            await cast(Any, c).nodes_manager.initialize()


def node_name(c: Redis, key: str) -> str:
    """Which server holds ``key`` (``host:port``); one name for all keys on one server.
    Only meaningful after the client made its first call (a cluster learns its slots
    then)."""
    if not is_cluster(c):
        return ""
    node = cast(Any, c).get_node_from_key(key)
    return "" if node is None else str(node.name)
