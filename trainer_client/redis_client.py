"""The trainer's Redis clients, one server or a Redis Cluster as the URL says
(:mod:`trainguard.core.redis_url`)."""

from __future__ import annotations

from typing import Any, cast

import redis
from redis.cluster import ClusterNode, RedisCluster

from trainguard.core import redis_url

__all__ = ["client", "is_cluster"]


def client(url: str, **kwargs: Any) -> redis.Redis:
    """A sync client of ``url``. ``kwargs`` go to redis-py (timeouts, driver info).

    A cluster client is typed as :class:`redis.Redis`: ``RedisCluster`` answers the same
    commands (routing each by its key's slot, following MOVED and ASK), and the few
    paths that need a node's connection ask :func:`is_cluster` first."""
    target = redis_url.parse(url)
    if not target.cluster:
        return redis.Redis.from_url(url, **kwargs)
    return cast(redis.Redis, RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
        username=target.username, password=target.password, ssl=target.ssl, **kwargs,
    ))


def is_cluster(c: object) -> bool:
    return isinstance(c, RedisCluster)
