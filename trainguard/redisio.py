"""The Redis floor: what every part that talks to Redis knows of redis-py alike. Here
the errors after which the same call may succeed; the service's asyncio clients
(``ingest_service.redis_client``) and the trainer's sync ones
(``trainer_client.redis_client``, ``redis_retry``) retry on these and nothing else.

Imports redis, so it stands above :mod:`trainguard.core` (which imports none) and
below the parts (import-linter's layers).
"""

from __future__ import annotations

from redis import exceptions as redis_errors

__all__ = ["FAILOVER_ERRORS", "TRANSIENT"]

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
