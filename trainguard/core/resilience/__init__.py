"""Resilience for remote dependencies: one circuit breaker (sync and async callers)
and one retry mechanism (:class:`RetryPolicy`, applied per call by :class:`Retrier`
and per loop by :class:`Backoff`), with their own error base.

Imports no client library: the parts name what is transient for theirs."""

from trainguard.core.resilience.breaker import REGISTRY, BreakerState, CircuitBreaker
from trainguard.core.resilience.errors import CircuitOpenError, ResilienceError
from trainguard.core.resilience.retry import (
    DEFAULT_POLICY,
    OBJECT_STORE_NOT_TRANSIENT,
    OBJECT_STORE_POLICY,
    Backoff,
    Retrier,
    RetryPolicy,
    object_store_breaker,
    object_store_errors,
    object_store_retrier,
    retry_testing,
)

__all__ = [
    "DEFAULT_POLICY",
    "OBJECT_STORE_NOT_TRANSIENT",
    "OBJECT_STORE_POLICY",
    "REGISTRY",
    "Backoff",
    "BreakerState",
    "CircuitBreaker",
    "CircuitOpenError",
    "ResilienceError",
    "Retrier",
    "RetryPolicy",
    "object_store_breaker",
    "object_store_errors",
    "object_store_retrier",
    "retry_testing",
]
