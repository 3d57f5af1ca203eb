"""The errors of :mod:`trainguard.core.resilience`: one base, each also the built-in
that matches its meaning (``except ConnectionError`` catches an open breaker)."""

from __future__ import annotations

from trainguard.core.errors import TrainguardError

__all__ = ["CircuitOpenError", "ResilienceError"]


class ResilienceError(TrainguardError):
    """Base class of every error that the breaker and retry helpers raise on purpose."""


class CircuitOpenError(ResilienceError, ConnectionError):
    """A circuit breaker refused the call without trying it.

    Raised while the breaker is open (the dependency failed recently) and, in
    half-open state, to every caller but the single probe. ``retry_after_s`` is how
    long until the breaker lets the next probe through (0.0 while a probe is in
    flight: the answer is expected any moment).
    """

    def __init__(self, name: str, state: str, retry_after_s: float) -> None:
        self.name = name
        self.state = state
        self.retry_after_s = retry_after_s
        if state == "half_open":
            detail = "a probe call is in flight to test whether it recovered"
        else:
            detail = f"the next probe is allowed in {retry_after_s:.3f} s"
        super().__init__(
            f"circuit breaker {name!r} is {state}: the call was refused without being "
            f"tried because the dependency failed recently; {detail}. Wait and retry "
            "(a trainguard Retrier does this for you)."
        )
