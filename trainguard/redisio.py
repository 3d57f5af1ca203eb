"""The Redis floor: what every part that talks to Redis knows of redis-py alike. Here
the errors after which the same call may succeed, the clients of a URL (sync for the
trainer and the rendezvous, asyncio for the service) and how to tell a cluster client;
the service's ``ingest_service.redis_client`` and the trainer's
``trainer_client.redis_client`` and ``redis_retry`` build on these.

Imports redis, so it stands above :mod:`trainguard.core` (which imports none) and
below the parts (import-linter's layers).
"""

from __future__ import annotations

from typing import Any, cast

import redis
import redis.asyncio
from redis import exceptions as redis_errors
from redis.asyncio import cluster as async_cluster
from redis.cluster import ClusterNode, RedisCluster

from trainguard.core import redis_url

__all__ = ["FAILOVER_ERRORS", "RETRY_ON", "TRANSIENT", "async_client", "is_cluster", "sync_client"]

FAILOVER_ERRORS: tuple[type[Exception], ...] = (
    redis_errors.ClusterDownError, redis_errors.TryAgainError, redis_errors.ReadOnlyError,
    redis_errors.MovedError, redis_errors.AskError, redis_errors.ClusterError,
)
"""What a Redis Cluster answers during a failover (no master for a slot yet: CLUSTERDOWN,
MASTERDOWN, TRYAGAIN; a write to a demoted master: READONLY; a slot moved under one of
our own connections: MOVED, ASK; redis-py's own retries used up: ClusterError):
transient, like a connection error."""

TRANSIENT: tuple[type[Exception], ...] = (
    redis_errors.ConnectionError,  # includes BusyLoadingError (Redis loading its AOF)
    redis_errors.TimeoutError, *FAILOVER_ERRORS,
)
"""Errors after which the same call may succeed: a lost connection, a failover."""

RETRY_ON: tuple[type[Exception], ...] = (*TRANSIENT, ConnectionError, TimeoutError)
"""What a retrier of sync redis-py calls retries: :data:`TRANSIENT` and the built-in
errors a socket raises under redis-py. Not :data:`TRANSIENT` itself, because in asyncio
code the built-in ``TimeoutError`` is also a request's own deadline, which is no Redis
outage."""


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A sync client of ``url`` (:mod:`trainguard.core.redis_url`: one server or a
    Redis Cluster). ``kwargs`` go to redis-py (timeouts, driver info).

    A cluster client is typed as :class:`redis.Redis`: ``RedisCluster`` answers the same
    commands (routing each by its key's slot, following MOVED and ASK), and the few
    paths that need a node's connection ask :func:`is_cluster` first."""
    target = redis_url.parse(url)
    if not target.cluster:
        return redis.Redis.from_url(url, **kwargs)
    return cast(redis.Redis, RedisCluster(
        # redis-py leaves the sync ClusterNode's __init__ unannotated (the async one is)
        startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],  # type: ignore[no-untyped-call]
        username=target.username, password=target.password, ssl=target.ssl, **kwargs,
    ))


def async_client(url: str, *, queue_timeout_s: float | None = None,
                 **kwargs: Any) -> redis.asyncio.Redis:
    """An asyncio client of ``url``; ``kwargs`` go to redis-py. A cluster client is
    typed as :class:`redis.asyncio.Redis` (it answers the same commands, routed by
    slot); the paths that need one node's connection ask :func:`is_cluster` first.

    ``queue_timeout_s``: a request finding all ``max_connections`` in use waits up to
    this long for one (a blocking pool) instead of failing at once, as redis-py's
    default pool does: a burst of reads queues rather than answering 503."""
    target = redis_url.parse(url)
    if not target.cluster:
        if queue_timeout_s is not None:
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                url, timeout=queue_timeout_s, **kwargs)
            return redis.asyncio.Redis(connection_pool=pool)
        return redis.asyncio.Redis.from_url(url, **kwargs)
    # A cluster client keeps one pool per node: the single-server pool size is per node.
    kwargs.pop("max_connections", None)
    return cast(redis.asyncio.Redis, _AsyncCluster(
        startup_nodes=[async_cluster.ClusterNode(h, p) for h, p in target.nodes],
        username=target.username, password=target.password, ssl=target.ssl, **kwargs,
    ))


class _AsyncCluster(async_cluster.RedisCluster):
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
    """Whether ``c`` is a Redis Cluster client, sync or asyncio (either factory's)."""
    return isinstance(c, RedisCluster | async_cluster.RedisCluster)
