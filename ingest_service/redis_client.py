"""The service's asyncio Redis clients, one server or a Redis Cluster as the URL says
(:mod:`trainguard.core.redis_url`)."""

from __future__ import annotations

import contextlib
from typing import Any, cast

from redis import exceptions as redis_errors
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from trainguard import redisio
from trainguard.core import redis_url

__all__ = ["FAILOVER_ERRORS", "TRANSIENT", "client", "is_cluster", "node_name", "pool_for", "refresh"]


# The transient errors are the Redis floor's, one list for every part.
FAILOVER_ERRORS, TRANSIENT = redisio.FAILOVER_ERRORS, redisio.TRANSIENT


def client(url: str, *, queue_timeout_s: float | None = None, **kwargs: Any) -> Redis:
    """An asyncio client of ``url``; ``kwargs`` go to redis-py. A cluster client is
    typed as :class:`Redis` (it answers the same commands, routed by slot); the paths
    that need one node's connection ask :func:`is_cluster` first.

    ``queue_timeout_s``: a request finding all ``max_connections`` in use waits up to
    this long for one (a blocking pool) instead of failing at once, as redis-py's
    default pool does: a burst of reads queues rather than answering 503."""
    target = redis_url.parse(url)
    if not target.cluster:
        if queue_timeout_s is not None:
            pool = BlockingConnectionPool.from_url(url, timeout=queue_timeout_s, **kwargs)
            return Redis(connection_pool=pool)
        return Redis.from_url(url, **kwargs)
    # A cluster client keeps one pool per node: the single-server pool size is per node.
    kwargs.pop("max_connections", None)
    return cast(Redis, _Cluster(
        startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
        username=target.username, password=target.password, ssl=target.ssl, **kwargs,
    ))


class _Cluster(RedisCluster):
    """redis-py's asyncio cluster client, its slot map read before a command is routed.

    redis-py 8.1 picks a command's target before it reads the slots: a command started
    while the client has no slot map yet (a fresh client, or one reset by ``aclose``)
    is routed as keyless, to a node that does not hold its key, and answered MOVED.
    Ten concurrent first commands so draw five MOVED, and redis-py's fifth
    (``reinitialize_steps``) calls ``aclose()``, which disconnects every connection,
    those other tasks are sending on included: they fail with ``AttributeError:
    'NoneType' object has no attribute 'writelines'`` (not a ConnectionError, so no
    retry catches it). Compare redis/redis-py#2437 (a first command on an
    uninitialized async cluster fails; a PING first avoids it), #4322 (the MOVED
    path's ``aclose``) and #4287 (a closed writer leaks AttributeError). Awaiting
    ``initialize`` first (it serializes callers on its lock, and does nothing once the
    slots are known) makes every command routed by its key's slot."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            await self.initialize()
        return await super().execute_command(*args, **kwargs)


def is_cluster(c: object) -> bool:
    return isinstance(c, RedisCluster)


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
