"""Retries with jittered exponential backoff (on ``stamina``), combined with a breaker.

One mechanism, two shapes:

- :class:`Retrier` (``.call`` / ``.acall``) retries one call on the given
  exceptions. With a ``breaker``, every attempt goes through it, and an open breaker
  makes the caller *wait* until the breaker admits the next probe (its
  ``retry_after_s`` plus a little jitter) instead of failing or spinning; the attempt
  after the wait is either the half-open probe or fails fast again while another
  caller's probe is in flight.
- :class:`Backoff` (in :mod:`trainguard.core.backoff`, standard library only, with
  :class:`RetryPolicy`) hands out the waits of the same policy to a loop that
  retries by itself (a producer syncing again, an uploader with a queue): the loop
  decides what an attempt is and how it waits (a stop event, a condition), the policy
  decides how long.

::

    s3 = object_store_retrier(object_store_breaker("s3:ckpt"))
    s3.call(fs.pipe_file, path, data)   # waits out an S3 outage, raises FileNotFoundError

When the policy's attempts or timeout run out, the last exception is raised
unchanged (a ``CircuitOpenError`` or the dependency's own error). Redis' transient
errors are named by the parts that talk to Redis (``trainer_client.redis_retry``,
``ingest_service.producer.producer``): this module imports no client library.

Tests switch the waiting off with ``with retry_testing(): ...`` (stamina's testing
mode: no backoff, ``attempts`` tries).
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, ParamSpec, TypeVar

import stamina

# The policy and the loop's waits live in the stdlib-only module (the push client
# imports them without stamina); re-exported here so every existing import works.
from trainguard.core.backoff import DEFAULT_POLICY, Backoff, RetryPolicy
from trainguard.core.resilience.breaker import CircuitBreaker
from trainguard.core.resilience.errors import CircuitOpenError

__all__ = [
    "DEFAULT_POLICY",
    "OBJECT_STORE_NOT_TRANSIENT",
    "OBJECT_STORE_POLICY",
    "Backoff",
    "Retrier",
    "RetryPolicy",
    "object_store_breaker",
    "object_store_errors",
    "object_store_retrier",
    "retry_testing",
]

P = ParamSpec("P")
T = TypeVar("T")


def retry_testing(attempts: int = 1) -> AbstractContextManager[None]:
    """Context manager: no backoff waits and exactly ``attempts`` tries per call
    (including waits for an open breaker). ``with retry_testing(): ...``"""
    return stamina.set_testing(True, attempts=attempts)


def _backoff_hook(
    on: tuple[type[BaseException], ...],
    ignore: tuple[type[BaseException], ...],
    policy: RetryPolicy,
) -> Callable[[Exception], bool | float]:
    def hook(exc: Exception) -> bool | float:
        if isinstance(exc, CircuitOpenError):
            # Sleep until the breaker admits a probe (at least wait_initial_s while
            # another caller's probe is in flight); the jitter keeps a crowd of
            # waiting callers from arriving at the same instant.
            return max(exc.retry_after_s, policy.wait_initial_s) + random.uniform(
                0.0, policy.wait_initial_s
            )
        return isinstance(exc, on) and not isinstance(exc, ignore)

    return hook


class Retrier:
    """Retries calls on ``on`` but not ``ignore`` (and waits out an open ``breaker``,
    through which every attempt goes) with jittered exponential backoff. Stateless
    apart from its configuration: share one per dependency."""

    def __init__(
        self,
        *,
        on: tuple[type[BaseException], ...],
        ignore: tuple[type[BaseException], ...] = (),
        breaker: CircuitBreaker | None = None,
        policy: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        self.ignore = ignore
        self.on = on
        self.breaker = breaker
        self.policy = policy

    def __repr__(self) -> str:
        return f"Retrier(on={self.on!r}, breaker={self.breaker!r}, policy={self.policy!r})"

    def _kwargs(self) -> dict[str, Any]:
        p = self.policy
        return {
            "on": _backoff_hook(self.on, self.ignore, p),
            "attempts": p.attempts,
            "timeout": p.timeout_s,
            "wait_initial": p.wait_initial_s,
            "wait_max": p.wait_max_s,
            "wait_jitter": p.wait_jitter_s,
            "wait_exp_base": p.wait_exp_base,
        }

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Call ``fn(*args, **kwargs)`` until it succeeds or the policy runs out."""
        for attempt in stamina.retry_context(**self._kwargs()):
            with attempt:
                if self.breaker is None:
                    return fn(*args, **kwargs)
                return self.breaker.call(fn, *args, **kwargs)
        # stamina either returns from inside the loop or re-raises the last error.
        raise AssertionError("stamina.retry_context ended without a result or an error")

    async def acall(
        self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """The async twin of :meth:`call` (waits with ``asyncio.sleep``)."""
        async for attempt in stamina.retry_context(**self._kwargs()):
            with attempt:
                if self.breaker is None:
                    return await fn(*args, **kwargs)
                return await self.breaker.acall(fn, *args, **kwargs)
        raise AssertionError("stamina.retry_context ended without a result or an error")


# -- object stores (fsspec: s3fs, gcsfs, local) ----------------------------------------

OBJECT_STORE_POLICY = RetryPolicy(attempts=None, timeout_s=900.0, wait_max_s=30.0)
"""Object-store outages: keep trying for up to 15 minutes, backing off to 30 s."""

OBJECT_STORE_NOT_TRANSIENT: tuple[type[Exception], ...] = (
    FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
)
"""OSErrors that are answers, not outages: never retried, never breaker failures."""


def object_store_errors() -> tuple[type[Exception], ...]:
    """Transient object-store errors: ``OSError`` (``TimeoutError``, ``ConnectionError``),
    plus botocore's connection and timeout errors when botocore is installed: s3fs
    raises ``botocore.exceptions.EndpointConnectionError``, which is *not* an
    ``OSError``, when the endpoint is down. Imported lazily, so that
    nothing needs the s3 extra."""
    errors: tuple[type[Exception], ...] = (OSError,)
    try:
        from botocore import exceptions as boto
    except ImportError:
        return errors
    return (*errors, boto.ConnectionError, boto.HTTPClientError)


def object_store_breaker(name: str = "object-store", **kwargs: Any) -> CircuitBreaker:
    """A breaker for one object store: transient errors are failures; "not found",
    "exists", "permission denied" are answers."""
    kwargs.setdefault("failure_exceptions", object_store_errors())
    kwargs.setdefault("ignored_exceptions", OBJECT_STORE_NOT_TRANSIENT)
    return CircuitBreaker(name, **kwargs)


def object_store_retrier(
    breaker: CircuitBreaker, policy: RetryPolicy = OBJECT_STORE_POLICY
) -> Retrier:
    """A :class:`Retrier` for fsspec calls through ``breaker``: an outage makes the
    caller wait and retry; a missing file is raised at once."""
    return Retrier(on=object_store_errors(), ignore=OBJECT_STORE_NOT_TRANSIENT,
                   breaker=breaker, policy=policy)
