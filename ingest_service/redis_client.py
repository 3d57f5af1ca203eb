"""The service's asyncio Redis clients, one server or a Redis Cluster as the URL says
(:mod:`trainguard.core.redis_url`)."""

from __future__ import annotations

from typing import Any, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster

from trainguard.core import redis_url

__all__ = ["client", "is_cluster"]


def client(url: str, **kwargs: Any) -> Redis:
    """An asyncio client of ``url``; ``kwargs`` go to redis-py. A cluster client is
    typed as :class:`Redis` (it answers the same commands, routed by slot); the paths
    that need one node's connection ask :func:`is_cluster` first."""
    target = redis_url.parse(url)
    if not target.cluster:
        return Redis.from_url(url, **kwargs)
    # A cluster client keeps one pool per node: the single-server pool size is per node.
    kwargs.pop("max_connections", None)
    return cast(Redis, RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
        username=target.username, password=target.password, ssl=target.ssl, **kwargs,
    ))


def is_cluster(c: object) -> bool:
    return isinstance(c, RedisCluster)
