"""One circuit breaker for sync and async callers.

States and transitions::

    CLOSED ──(failure_threshold consecutive failures, or failure rate over the
    │          window above failure_rate_threshold)──► OPEN
    OPEN ──(reset_timeout_s elapsed; the next caller becomes the probe)──► HALF_OPEN
    HALF_OPEN ──(probe succeeds)──► CLOSED
    HALF_OPEN ──(probe fails)──► OPEN (the timeout starts again)

While OPEN every call fails fast with :class:`CircuitOpenError`. In HALF_OPEN exactly
one call (the probe) reaches the dependency; every concurrent caller, thread or
asyncio task, fails fast. Admission and outcome are decided under one
``threading.Lock`` that is never held across a call or an ``await``, so the same
breaker serves threads and event loops at once. A forked child (DataLoader worker)
gets fresh locks and inherits the state.

Outcomes: an exception that is an instance of ``failure_exceptions`` and not of
``ignored_exceptions`` is a failure. Any other exception means the dependency
answered (e.g. "not found"), so it counts as a success for the breaker and is
re-raised unchanged. A call that is abandoned with a ``BaseException`` that is not an
``Exception`` (task cancelled, KeyboardInterrupt) decides nothing: if it was the
probe, the next caller probes instead. Outcomes of calls admitted before the last
transition are ignored, so a slow call from before an outage cannot close the
breaker and a slow failure from before recovery cannot reopen it.

A hanging call never ends, so the breaker would stay half-open: give every protected
call its own timeout (socket timeout, ``asyncio.timeout`` inside the coroutine).

Metrics (on ``registry``, default :data:`REGISTRY`, not prometheus' global one)::

    trainguard_breaker_state{breaker, trainguard_breaker_state}   enum: closed/open/half_open
    trainguard_breaker_transitions_total{breaker, from_state, to_state}
    trainguard_breaker_calls_total{breaker, outcome}   success/failure/rejected/abandoned
"""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from prometheus_client import CollectorRegistry, Counter
from prometheus_client import Enum as EnumMetric

from trainguard.core.resilience.errors import CircuitOpenError

__all__ = [
    "REGISTRY",
    "BreakerState",
    "CircuitBreaker",
    "CircuitOpenError",
]

P = ParamSpec("P")
T = TypeVar("T")

REGISTRY = CollectorRegistry(auto_describe=True)
"""trainguard's own metrics registry for breakers. Kept apart from
prometheus' process-global default so that tests and embedding applications decide
what they expose; serve it with ``prometheus_client.generate_latest(REGISTRY)``."""


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class _Metrics:
    state: EnumMetric
    transitions: Counter
    calls: Counter


_metrics_lock = threading.Lock()
_metrics_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = (
    weakref.WeakKeyDictionary()
)
_live_breakers: weakref.WeakSet[CircuitBreaker] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # DataLoader workers fork. A lock that another parent thread held at the fork
    # stays locked forever in the child (that thread does not exist there): give
    # every breaker, and the metrics registry map, a fresh lock.
    global _metrics_lock
    _metrics_lock = threading.Lock()
    for breaker in list(_live_breakers):
        breaker._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _metrics_for(registry: CollectorRegistry) -> _Metrics:
    # A metric family may be registered once per registry; every breaker on the same
    # registry shares the families and writes its own ``breaker`` label.
    with _metrics_lock:
        metrics = _metrics_by_registry.get(registry)
        if metrics is None:
            metrics = _Metrics(
                state=EnumMetric(
                    "trainguard_breaker_state",
                    "Current state of each circuit breaker.",
                    ["breaker"],
                    states=[s.value for s in BreakerState],
                    registry=registry,
                ),
                transitions=Counter(
                    "trainguard_breaker_transitions",
                    "Circuit breaker state transitions.",
                    ["breaker", "from_state", "to_state"],
                    registry=registry,
                ),
                calls=Counter(
                    "trainguard_breaker_calls",
                    "Calls through a circuit breaker by outcome "
                    "(success, failure, rejected without trying, abandoned).",
                    ["breaker", "outcome"],
                    registry=registry,
                ),
            )
            _metrics_by_registry[registry] = metrics
        return metrics


class CircuitBreaker:
    """A circuit breaker shared by every caller of one dependency.

    ``failure_threshold`` consecutive failures open it. If ``failure_rate_threshold``
    is set, it also opens when, over the last ``window_size`` decided calls (at least
    ``min_calls`` of them), the fraction of failures reaches that rate.
    ``acall_timeout_s`` bounds each :meth:`acall` (the ``TimeoutError`` is a failure):
    a timeout put *around* ``acall`` cancels it instead, and a cancelled call decides
    nothing, so hangs would never open the breaker.
    ``clock`` returns seconds on a monotonic scale; tests pass their own.
    """

    def __init__(
        self,
        name: str,
        *,
        failure_threshold: int = 5,
        reset_timeout_s: float = 30.0,
        failure_rate_threshold: float | None = None,
        window_size: int = 20,
        min_calls: int = 10,
        failure_exceptions: tuple[type[BaseException], ...] = (Exception,),
        ignored_exceptions: tuple[type[BaseException], ...] = (),
        acall_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if reset_timeout_s < 0:
            raise ValueError(f"reset_timeout_s must be >= 0, got {reset_timeout_s}")
        if failure_rate_threshold is not None and not 0.0 < failure_rate_threshold <= 1.0:
            raise ValueError(
                f"failure_rate_threshold must be in (0, 1], got {failure_rate_threshold}"
            )
        if window_size < 1 or not 1 <= min_calls <= window_size:
            raise ValueError(
                f"need window_size >= 1 and 1 <= min_calls <= window_size, "
                f"got window_size={window_size}, min_calls={min_calls}"
            )
        self.name = name
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self.failure_rate_threshold = failure_rate_threshold
        self.min_calls = min_calls
        self.failure_exceptions = failure_exceptions
        self.ignored_exceptions = ignored_exceptions
        self.acall_timeout_s = acall_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._generation = 0  # bumped on every transition; stale outcomes are ignored
        self._consecutive_failures = 0
        self._window: deque[bool] = deque(maxlen=window_size)  # True = failure
        self._opened_at = 0.0
        self._probe_in_flight = False
        self._metrics = _metrics_for(registry if registry is not None else REGISTRY)
        self._metrics.state.labels(name).state(self._state.value)
        _live_breakers.add(self)

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.name!r}, state={self.state.value})"

    # -- state ---------------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        """The current state. OPEN turns into HALF_OPEN only when a caller arrives
        after the timeout, so this reads OPEN until then; see :meth:`retry_after_s`."""
        with self._lock:
            return self._state

    def retry_after_s(self) -> float:
        """Seconds until a call could be admitted: 0.0 when closed, when the reset
        timeout has passed, or while a half-open probe is in flight."""
        with self._lock:
            if self._state is BreakerState.OPEN:
                return max(0.0, self._opened_at + self.reset_timeout_s - self._clock())
            return 0.0

    def reset(self) -> None:
        """Force the breaker closed (e.g. an operator knows the dependency is back)."""
        with self._lock:
            self._transition(BreakerState.CLOSED)

    def _transition(self, to: BreakerState) -> None:
        # Caller holds the lock.
        frm = self._state
        self._state = to
        self._generation += 1
        self._consecutive_failures = 0
        self._window.clear()
        self._probe_in_flight = False
        if to is BreakerState.OPEN:
            self._opened_at = self._clock()
        if frm is not to:
            self._metrics.transitions.labels(self.name, frm.value, to.value).inc()
        self._metrics.state.labels(self.name).state(to.value)

    # -- admission and outcome -----------------------------------------------------

    def _admit(self) -> _Ticket:
        with self._lock:
            if self._state is BreakerState.OPEN:
                remaining = self._opened_at + self.reset_timeout_s - self._clock()
                if remaining > 0:
                    self._metrics.calls.labels(self.name, "rejected").inc()
                    raise CircuitOpenError(self.name, BreakerState.OPEN.value, remaining)
                self._transition(BreakerState.HALF_OPEN)
            if self._state is BreakerState.HALF_OPEN:
                if self._probe_in_flight:
                    self._metrics.calls.labels(self.name, "rejected").inc()
                    raise CircuitOpenError(self.name, BreakerState.HALF_OPEN.value, 0.0)
                self._probe_in_flight = True
                return _Ticket(self._generation, probe=True)
            return _Ticket(self._generation, probe=False)

    def _is_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, self.failure_exceptions) and not isinstance(
            exc, self.ignored_exceptions
        )

    def _record(self, ticket: _Ticket, exc: BaseException | None) -> None:
        with self._lock:
            if exc is not None and not isinstance(exc, Exception):
                self._metrics.calls.labels(self.name, "abandoned").inc()
                if ticket.probe and ticket.generation == self._generation:
                    self._probe_in_flight = False  # let the next caller probe instead
                return
            failed = exc is not None and self._is_failure(exc)
            self._metrics.calls.labels(self.name, "failure" if failed else "success").inc()
            if ticket.generation != self._generation:
                return
            if self._state is BreakerState.HALF_OPEN:
                self._transition(BreakerState.OPEN if failed else BreakerState.CLOSED)
                return
            self._window.append(failed)
            if not failed:
                self._consecutive_failures = 0
                return
            self._consecutive_failures += 1
            if self._consecutive_failures >= self.failure_threshold or self._rate_exceeded():
                self._transition(BreakerState.OPEN)

    def _rate_exceeded(self) -> bool:
        if self.failure_rate_threshold is None or len(self._window) < self.min_calls:
            return False
        return sum(self._window) / len(self._window) >= self.failure_rate_threshold

    # -- public call styles --------------------------------------------------------

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Call ``fn(*args, **kwargs)`` through the breaker (raises CircuitOpenError
        without calling it while the breaker is open)."""
        ticket = self._admit()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            self._record(ticket, exc)
            raise
        self._record(ticket, None)
        return result

    async def acall(
        self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """Await ``fn(*args, **kwargs)`` through the breaker."""
        ticket = self._admit()
        try:
            if self.acall_timeout_s is None:
                result = await fn(*args, **kwargs)
            else:
                async with asyncio.timeout(self.acall_timeout_s):
                    result = await fn(*args, **kwargs)
        except BaseException as exc:
            self._record(ticket, exc)
            raise
        self._record(ticket, None)
        return result

    def guard(self) -> _Guard:
        """A context manager (``with`` or ``async with``) around one call::

            with breaker.guard():
                conn.ping()
        """
        return _Guard(self)

    def protect(self, fn: Callable[P, T]) -> Callable[P, T]:
        """Decorator: every call of ``fn`` (sync or ``async def``) goes through the
        breaker."""
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await self.acall(fn, *args, **kwargs)

            return async_wrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            return self.call(fn, *args, **kwargs)

        return wrapper


@dataclass(frozen=True)
class _Ticket:
    generation: int
    probe: bool


class _Guard:
    """One admission; not reusable across calls."""

    def __init__(self, breaker: CircuitBreaker) -> None:
        self._breaker = breaker
        self._ticket: _Ticket | None = None

    def __enter__(self) -> None:
        if self._ticket is not None:
            raise RuntimeError("a breaker guard is good for one call; call guard() again")
        self._ticket = self._breaker._admit()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._ticket is not None
        self._breaker._record(self._ticket, exc)

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)
