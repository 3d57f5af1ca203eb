"""The one Redis client and retrier of the rendezvous backend and store.

A failover of the master holding the run's slot, or a restart of a single Redis,
makes calls fail for a few seconds: they are retried with a short backoff (a
rendezvous waits on them, so seconds matter) for up to ``timeout_s``, then surface as
:class:`~trainguard.elastic.errors.RedisUnreachableError`, which torch's agent treats
as a rendezvous connection failure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import redis

from trainguard import redisio
from trainguard.core.redis_url import RedisUrlError
from trainguard.core.redis_url import parse as parse_url
from trainguard.core.resilience import Retrier, RetryPolicy
from trainguard.core.urls import redact_text
from trainguard.elastic.errors import ElasticConfigError, RedisUnreachableError

__all__ = ["Connection", "connect"]

P = ParamSpec("P")
T = TypeVar("T")

SOCKET_TIMEOUT_S = 5.0
"""A command that gets no answer in this long counts as failed and is retried (a
killed master does not always reset its connections)."""


class Connection:
    """A client of the rendezvous' Redis and the retrier of its calls. Shared by the
    backend and the store of one handler (redis-py clients are thread-safe; the
    handler's keep-alive thread and c10d's threads call it too)."""

    def __init__(self, url: str, *, retry_timeout_s: float = 60.0) -> None:
        try:
            parse_url(url)
        except RedisUrlError as e:
            raise ElasticConfigError(
                f"--rdzv-endpoint {redact_text(url)!r} is not a Redis URL: {e}"
            ) from e
        self.url = url
        self.client: redis.Redis = redisio.sync_client(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S)
        self._retrier = Retrier(on=redisio.RETRY_ON, policy=RetryPolicy(
            attempts=None, timeout_s=retry_timeout_s, wait_initial_s=0.05, wait_max_s=0.5,
            wait_jitter_s=0.05))
        self._retry_timeout_s = retry_timeout_s

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return self._retrier.call(fn, *args, **kwargs)
        except redisio.RETRY_ON as e:
            raise RedisUnreachableError(
                f"the rendezvous Redis {redact_text(self.url)} stayed out of reach for "
                f"{self._retry_timeout_s:.0f} s ({type(e).__name__}: {e}); check that it "
                "runs and that this node reaches it"
            ) from e

    def script(self, source: str) -> Any:
        """A Lua script of this client (EVALSHA, loaded again after a failover)."""
        return self.client.register_script(source)

    def close(self) -> None:
        self.client.close()


def connect(url: str, **kwargs: Any) -> Connection:
    return Connection(url, **kwargs)
