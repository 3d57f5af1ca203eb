"""The push route's own Redis connections: a bounded pool that queues, and shrinks.

The service's shared pool allows thousands of connections (each file producer holds
its writer links for an epoch) and never closes an idle one, so a burst of pushes
left hundreds of idle links open. Pushes get their own pool instead:

- at most ``max_connections`` (64): a request past them waits for a connection, in
  order, up to ``timeout_s`` (then 503, retry), instead of opening one more;
- connections idle for longer than ``idle_s`` are closed by :meth:`TrimmedPool.trim`
  (run every ``idle_s`` by :func:`run_trim`), down to ``keep_idle``.

A Redis Cluster client keeps its own pool per node; it is left as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection

from ingest_service import redis_client
from trainguard.core import redis_url

__all__ = ["TrimmedPool", "push_client", "run_trim"]


class TrimmedPool(BlockingConnectionPool):
    """A BlockingConnectionPool that remembers when each idle connection was released
    and closes those idle too long."""

    def __init__(self, *, keep_idle: int = 4, idle_s: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.keep_idle, self.idle_s = keep_idle, idle_s
        self._released: dict[int, float] = {}

    async def release(self, connection: AbstractConnection) -> None:
        self._released[id(connection)] = time.monotonic()
        await super().release(connection)

    def counts(self) -> tuple[int, int]:
        """(idle, in use) connections."""
        return len(self._available_connections), len(self._in_use_connections)

    async def trim(self) -> int:
        """Close the connections idle for longer than ``idle_s`` beyond the
        ``keep_idle`` most recently used; how many were closed."""
        now = time.monotonic()
        async with self._condition:
            # redis-py hands out the last released first: the oldest are at the front.
            idle = self._available_connections
            doomed = [c for c in idle[:max(0, len(idle) - self.keep_idle)]
                      if now - self._released.get(id(c), now) > self.idle_s]
            for c in doomed:
                idle.remove(c)
                self._released.pop(id(c), None)
        for c in doomed:
            with contextlib.suppress(Exception):  # closing a dead link: nothing to keep
                await c.disconnect()
        return len(doomed)


def push_client(url: str, *, max_connections: int, timeout_s: float, idle_s: float,
                **kwargs: Any) -> Redis:
    """The push route's client of ``url``: on one server, over a :class:`TrimmedPool`;
    on a cluster, the cluster client (its pools are per node)."""
    if redis_url.parse(url).cluster:
        return redis_client.client(url, **kwargs)
    pool = TrimmedPool.from_url(url, max_connections=max_connections, timeout=timeout_s,
                                idle_s=idle_s, **kwargs)
    return Redis(connection_pool=pool)


async def run_trim(client: Redis, stopping: asyncio.Event) -> None:
    """Trim ``client``'s pool every ``idle_s`` until ``stopping``."""
    pool = client.connection_pool if not redis_client.is_cluster(client) else None
    if not isinstance(pool, TrimmedPool):
        return
    while not stopping.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), pool.idle_s)
        await pool.trim()
