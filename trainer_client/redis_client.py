"""The trainer's Redis clients, one server or a Redis Cluster as the URL says: the
client of a URL is the Redis floor's (:func:`trainguard.redisio.sync_client`); here
what only the trainer does with one: every server, per-master pipelines, a blocking
wait over partitions, one client per process."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import redis

from trainguard import redisio

__all__ = ["wait_any", "REPLICA_WAIT_MS", "ProcessClient", "client", "eval_per_node", "is_cluster", "servers"]


# The client of a URL and the cluster test are the Redis floor's, one home for every
# part; these names stay for the trainer's modules.
client = redisio.sync_client
is_cluster = redisio.is_cluster


def servers(c: redis.Redis) -> list[redis.Redis]:
    """A client of every server: the one, or every node of a cluster (masters and
    replicas), its slots looked up again first (a failover may have made new masters)."""
    if not is_cluster(c):
        return [c]
    cluster: Any = c
    cluster.nodes_manager.initialize()
    return [cluster.get_redis_connection(n) for n in cluster.get_nodes()]


REPLICA_WAIT_MS = 1000


def eval_per_node(
    client: redis.Redis, sha: str, calls: list[tuple[list[str], list[Any]]], *, replicated: bool
) -> list[Any]:
    """EVALSHA of ``calls`` on a cluster: one pipeline per master on one of its
    connections (each call in its keys' slot), with ``WAIT 1`` at its end when
    ``replicated`` and the master has a replica (best effort: a replica that does not
    answer within ``REPLICA_WAIT_MS`` is not waited for longer). Results in the
    order of ``calls``; a failover error makes the client read the slots again and
    propagates (the caller's retrier tries again)."""
    cluster: Any = client
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i, (keys, _) in enumerate(calls):
        node = cluster.get_node_from_key(keys[0])
        by_node.setdefault(node.name, (node, []))[1].append(i)
    out: list[Any] = [None] * len(calls)
    try:
        for node, indices in by_node.values():
            pipe = node.redis_connection.pipeline(transaction=False)
            for i in indices:
                keys, args = calls[i]
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            slot = cluster.keyslot(calls[indices[0]][0][0])
            wait = replicated and len(cluster.nodes_manager.slots_cache.get(slot, ())) > 1
            if wait:
                pipe.execute_command("WAIT", 1, REPLICA_WAIT_MS)
            results = pipe.execute(raise_on_error=False)
            for i, r in zip(indices, results):
                if isinstance(r, redis.exceptions.ConnectionError | redis.exceptions.MovedError):
                    raise r
                out[i] = r
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
            redis.exceptions.MovedError, redis.exceptions.AskError):
        with contextlib.suppress(redis.exceptions.RedisError):
            cluster.nodes_manager.initialize()
        raise
    return out


CLUSTER_WAIT_MS = 50
"""On a cluster, how long one blocking read of one partition waits before the others
are looked at again."""


def wait_any(client: redis.Redis, keys: dict[Any, Any], block_ms: int) -> None:
    """Return once one of ``keys`` (stream -> ID) has entries after its ID, or after
    about ``block_ms``. One XREAD BLOCK on one server; on a cluster, where one XREAD
    cannot span slots, a pipelined non-blocking XREAD per stream (per master), then
    short blocking reads of one stream in turn, so entries on any stream are seen
    within ``CLUSTER_WAIT_MS``."""
    if not is_cluster(client):
        client.xread(keys, count=1, block=block_ms)
        return
    order = list(keys)
    deadline = time.monotonic() + block_ms / 1000
    turn = 0
    while True:
        pipe = client.pipeline(transaction=False)
        for key in order:
            pipe.xread({key: keys[key]}, count=1)
        if any(pipe.execute()):
            return
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return
        key = order[turn % len(order)]
        turn += 1
        if client.xread({key: keys[key]}, count=1, block=min(left_ms, CLUSTER_WAIT_MS)):
            return


class ProcessClient:
    """One process's client of ``url``, made on first use and kept (on a cluster,
    making one costs about 10 ms: the slot map and the command table). A process that
    inherited a copy by fork (a DataLoader worker) makes its own and leaves the
    parent's connections alone; a pickled copy carries no client."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.url = url
        self._kwargs = kwargs
        self._client: redis.Redis | None = None
        self._pid = 0

    def get(self) -> redis.Redis:
        if self._client is None or self._pid != os.getpid():
            self._client = client(self.url, **self._kwargs)
            self._pid = os.getpid()
        return self._client

    def drop(self) -> None:
        """Close this process's client (after a connection error: a connection cut off
        mid-command may still have a reply in flight, so none of it is reused)."""
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}
