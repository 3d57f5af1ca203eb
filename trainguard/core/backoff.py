"""Backoff, the one description of how long to wait between tries: :class:`RetryPolicy`
(stamina's parameters) and :class:`Backoff` (its waits, handed out to a loop that
retries by itself).

Standard library only (import-linter checks it): the push client
(:mod:`trainguard.push`), which promises stdlib and msgpack, takes its waits from
here, and so does :mod:`trainguard.core.resilience.retry`, which applies a policy per
call through stamina. It lives beside ``resilience/`` rather than in it because that
package's ``__init__`` imports stamina.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["DEFAULT_POLICY", "Backoff", "RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff parameters (stamina's): wait ``min(wait_max_s, wait_initial_s *
    wait_exp_base ** (n - 1) + uniform(0, wait_jitter_s))`` before attempt ``n + 1``;
    stop after ``attempts`` tries or ``timeout_s`` in total (``None``: no limit)."""

    attempts: int | None = 10
    timeout_s: float | None = 45.0
    wait_initial_s: float = 0.1
    wait_max_s: float = 5.0
    wait_jitter_s: float = 1.0
    wait_exp_base: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be >= 1 or None, got {self.attempts}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")

    def wait_s(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row (1 for the first)."""
        n = max(1, failures)
        return min(
            self.wait_max_s,
            self.wait_initial_s * self.wait_exp_base ** (n - 1)
            + random.uniform(0.0, self.wait_jitter_s),
        )


class Backoff:
    """The waits of ``policy`` for a loop that retries by itself::

        backoff = Backoff(policy)
        while not stopped:
            try:
                work()
                backoff.reset()
            except TransientError:
                stop_event.wait(backoff.next_wait_s())

    Unlike :class:`~trainguard.core.resilience.Retrier` it never gives up: the loop
    owns its stop condition (``policy.attempts`` and ``timeout_s`` are not applied
    here).
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.failures = 0

    def next_wait_s(self) -> float:
        """Count one more failure and return how long to wait before the next try."""
        self.failures += 1
        return self.policy.wait_s(self.failures)

    def reset(self) -> None:
        """A success: the next failure waits ``wait_initial_s`` again."""
        self.failures = 0


DEFAULT_POLICY = RetryPolicy()
