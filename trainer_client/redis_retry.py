"""Redis calls that wait out an outage: the trainer's breaker and retrier for Redis.

The mechanism is :mod:`trainguard.core.resilience` (one breaker, one retry policy type);
this module names what is transient for redis-py and how long a trainer waits::

    breaker = redis_breaker("redis:trainer")          # one per Redis, shared
    offsets = redis_call(breaker, client.hgetall, key)

A Redis outage (restart, failover, AOF reload) then makes training wait and retry
instead of crashing; a ``ResponseError`` (WRONGTYPE, BUSYGROUP, ...) means Redis
answered and is neither retried nor counted against the breaker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from trainguard import redisio
from trainguard.core.resilience import CircuitBreaker, Retrier, RetryPolicy

__all__ = [
    "REDIS_POLICY",
    "REDIS_RETRY_ON",
    "aredis_call",
    "redis_breaker",
    "redis_call",
    "redis_retrier",
    "trainer_redis_breaker",
    "trainer_redis_retrier",
]

P = ParamSpec("P")
T = TypeVar("T")

REDIS_POLICY = RetryPolicy(attempts=None, timeout_s=900.0, wait_max_s=10.0)
"""Redis outages (restart, failover, AOF reload) take seconds to minutes: keep trying
for up to 15 minutes, then let the error surface so the orchestrator restarts us."""

REDIS_RETRY_ON = redisio.RETRY_ON
"""The Redis floor's :data:`trainguard.redisio.RETRY_ON`, under the name this module's
callers use."""


def redis_breaker(name: str = "redis", **kwargs: Any) -> CircuitBreaker:
    """A breaker that counts only transient Redis errors as failures (a Redis
    ``ResponseError`` means Redis is up). ``kwargs`` go to :class:`CircuitBreaker`."""
    kwargs.setdefault("failure_exceptions", REDIS_RETRY_ON)
    return CircuitBreaker(name, **kwargs)


def redis_retrier(breaker: CircuitBreaker, policy: RetryPolicy = REDIS_POLICY) -> Retrier:
    """A :class:`Retrier` for redis-py calls (sync or ``redis.asyncio``) through
    ``breaker``: retries transient errors, waits while the breaker is open."""
    return Retrier(on=REDIS_RETRY_ON, breaker=breaker, policy=policy)


def redis_call(breaker: CircuitBreaker, fn: Callable[P, T], /, *args: P.args,
               **kwargs: P.kwargs) -> T:
    """``redis_retrier(breaker).call(fn, *args, **kwargs)`` with :data:`REDIS_POLICY`."""
    return redis_retrier(breaker).call(fn, *args, **kwargs)


async def aredis_call(
    breaker: CircuitBreaker, fn: Callable[P, Awaitable[T]], /, *args: P.args,
    **kwargs: P.kwargs,
) -> T:
    """The async twin of :func:`redis_call`."""
    return await redis_retrier(breaker).acall(fn, *args, **kwargs)


def trainer_redis_breaker(name: str) -> CircuitBreaker:
    """The breaker of the training client's Redis calls: it admits a probe every
    second, so training resumes within about a second of Redis coming back."""
    return redis_breaker(name, reset_timeout_s=1.0)


def trainer_redis_retrier(breaker: CircuitBreaker, timeout_s: float) -> Retrier:
    """The retrier of the training client's Redis calls (session and readers) through
    ``breaker``: waits out an outage for up to ``timeout_s``, backing off to at most
    2 s (a restart takes seconds; a long wait per call would cost more than the
    retries save)."""
    policy = dataclasses.replace(REDIS_POLICY, timeout_s=timeout_s, wait_max_s=2.0)
    return redis_retrier(breaker, policy)
