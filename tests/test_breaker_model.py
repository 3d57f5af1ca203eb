"""Stateful property test: the breaker follows a reference model of its state machine
for any sequence of successes, failures, failure-rate windows and clock moves."""

from __future__ import annotations

from collections import deque

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from prometheus_client import CollectorRegistry

from tests._http_servers import ManualClock
from trainguard.core.resilience import CircuitOpenError
from trainguard.core.resilience.breaker import BreakerState, CircuitBreaker

THRESHOLD, RESET_S, WINDOW, MIN_CALLS, RATE = 3, 10.0, 6, 4, 0.5


class BreakerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.breaker = CircuitBreaker(
            "model", failure_threshold=THRESHOLD, reset_timeout_s=RESET_S,
            failure_rate_threshold=RATE, window_size=WINDOW, min_calls=MIN_CALLS,
            clock=self.clock, registry=CollectorRegistry(),
        )
        self.state = BreakerState.CLOSED
        self.consecutive = 0
        self.window: deque[bool] = deque(maxlen=WINDOW)
        self.opened_at = 0.0

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = self.clock.now
        self.consecutive = 0
        self.window.clear()

    @rule(ok=st.booleans())
    def call(self, ok: bool) -> None:
        ran: list[bool] = []

        def fn() -> None:
            ran.append(True)
            if not ok:
                raise ConnectionError("down")

        expect_rejected = (self.state is BreakerState.OPEN
                           and self.clock.now < self.opened_at + RESET_S)
        try:
            self.breaker.call(fn)
        except CircuitOpenError:
            assert expect_rejected and not ran
            return
        except ConnectionError:
            assert not ok
        assert not expect_rejected and ran == [True]
        if self.state is BreakerState.OPEN:  # the timeout passed: this was the probe
            if ok:
                self.state, self.consecutive = BreakerState.CLOSED, 0
                self.window.clear()
            else:
                self._open()
            return
        self.window.append(not ok)
        if ok:
            self.consecutive = 0
            return
        self.consecutive += 1
        rate_hit = len(self.window) >= MIN_CALLS and sum(self.window) / len(self.window) >= RATE
        if self.consecutive >= THRESHOLD or rate_hit:
            self._open()

    @rule(dt=st.sampled_from([0.5, 3.0, 9.99, 10.0, 25.0]))
    def advance(self, dt: float) -> None:
        self.clock.advance(dt)

    @invariant()
    def same_state(self) -> None:
        assert self.breaker.state is self.state
        expected_wait = (max(0.0, self.opened_at + RESET_S - self.clock.now)
                         if self.state is BreakerState.OPEN else 0.0)
        assert abs(self.breaker.retry_after_s() - expected_wait) < 1e-9


BreakerModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)
test_breaker_follows_the_model = BreakerModel.TestCase
