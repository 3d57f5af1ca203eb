"""CircuitBreaker against a real local HTTP server that fails, hangs and recovers.

Time is a ManualClock: the breaker's reset timeout passes when the test advances it,
so no test sleeps for the breaker or asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from tests._http_servers import ControlledServer, ManualClock
from trainguard.core.resilience import CircuitOpenError, ResilienceError
from trainguard.core.resilience.breaker import BreakerState, CircuitBreaker

RESET_S = 30.0
CLIENT_TIMEOUT_S = 0.5


@pytest.fixture
def server() -> Iterator[ControlledServer]:
    srv = ControlledServer("dep").start()
    yield srv
    srv.stop()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def make_breaker(
    clock: ManualClock, registry: CollectorRegistry, **kwargs: object
) -> CircuitBreaker:
    kwargs.setdefault("failure_threshold", 3)
    return CircuitBreaker(
        "dep", reset_timeout_s=RESET_S, clock=clock, registry=registry, **kwargs  # type: ignore[arg-type]
    )


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=CLIENT_TIMEOUT_S) as resp:
        return int(resp.status)


def trip(breaker: CircuitBreaker, server: ControlledServer) -> None:
    server.set_mode("fail")
    for _ in range(breaker.failure_threshold):
        with pytest.raises(urllib.error.HTTPError):
            breaker.call(get, server.url)
    assert breaker.state is BreakerState.OPEN


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_opens_after_threshold_and_fails_fast(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """N consecutive failures open the breaker; while open, calls fail fast with
    CircuitOpenError and never reach the server."""
    breaker = make_breaker(clock, registry)
    server.set_mode("fail")
    for i in range(2):
        with pytest.raises(urllib.error.HTTPError):
            breaker.call(get, server.url)
        assert breaker.state is BreakerState.CLOSED, f"opened after only {i + 1} failures"
    with pytest.raises(urllib.error.HTTPError):
        breaker.call(get, server.url)
    assert breaker.state is BreakerState.OPEN
    assert server.hits == 3
    clock.advance(RESET_S - 1.0)
    for _ in range(5):
        with pytest.raises(CircuitOpenError) as info:
            breaker.call(get, server.url)
    assert server.hits == 3
    assert info.value.retry_after_s == pytest.approx(1.0)
    assert isinstance(info.value, ResilienceError) and isinstance(info.value, ConnectionError)
    assert breaker.retry_after_s() == pytest.approx(1.0)


def test_success_resets_the_consecutive_count(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """Only *consecutive* failures count: fail, fail, ok, fail, fail stays closed
    with a threshold of 3."""
    breaker = make_breaker(clock, registry)
    for mode in ("fail", "fail", "ok", "fail", "fail"):
        server.set_mode(mode)
        try:
            breaker.call(get, server.url)
        except urllib.error.HTTPError:
            pass
    assert breaker.state is BreakerState.CLOSED
    assert server.hits == 5


def test_failure_rate_over_window_opens(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """With failure_rate_threshold=0.5 over a window of 4 calls, alternating
    fail/ok stays closed until the window holds 4 calls, then the next failure that
    keeps the rate at 50% opens the breaker (no 3 consecutive failures ever)."""
    breaker = make_breaker(
        clock, registry, failure_threshold=3, failure_rate_threshold=0.5,
        window_size=4, min_calls=4,
    )
    for mode in ("fail", "ok", "fail", "ok"):
        server.set_mode(mode)
        try:
            breaker.call(get, server.url)
        except urllib.error.HTTPError:
            pass
        assert breaker.state is BreakerState.CLOSED
    server.set_mode("fail")
    with pytest.raises(urllib.error.HTTPError):
        breaker.call(get, server.url)
    assert breaker.state is BreakerState.OPEN


def test_half_open_lets_exactly_one_thread_probe(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """In half-open, of 8 concurrent threads exactly one request reaches the server
    (counted by the server); the other 7 fail fast; the probe's success closes the
    breaker and calls flow again."""
    breaker = make_breaker(clock, registry)
    trip(breaker, server)
    hits_before = server.hits
    clock.advance(RESET_S)
    server.set_mode("gate")
    results: queue.Queue[object] = queue.Queue()

    def worker() -> None:
        try:
            results.put(breaker.call(get, server.url))
        except Exception as exc:
            results.put(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    fast = [results.get(timeout=30) for _ in range(7)]
    assert all(isinstance(r, CircuitOpenError) for r in fast), fast
    assert breaker.state is BreakerState.HALF_OPEN
    server.wait_for_hits(hits_before + 1)
    assert server.hits == hits_before + 1
    server.release()
    assert results.get(timeout=30) == 200
    for t in threads:
        t.join(30)
    assert breaker.state is BreakerState.CLOSED
    server.set_mode("ok")
    assert [breaker.call(get, server.url) for _ in range(3)] == [200, 200, 200]
    assert server.hits == hits_before + 4
    assert sample(registry, "trainguard_breaker_calls_total", breaker="dep", outcome="rejected") == 7


async def test_half_open_lets_exactly_one_task_probe(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """The same breaker serves asyncio tasks: of 8 concurrent tasks in half-open,
    exactly one request reaches the server, 7 fail fast, success closes it."""
    breaker = make_breaker(clock, registry)
    trip(breaker, server)
    hits_before = server.hits
    clock.advance(RESET_S)
    server.set_mode("gate")
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def fetch() -> int:
            async with http.get(server.url) as resp:
                resp.raise_for_status()
                return resp.status

        tasks = [asyncio.create_task(breaker.acall(fetch)) for _ in range(8)]
        done, pending = await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        while len(done) < 7:
            more, pending = await asyncio.wait(
                pending, timeout=30, return_when=asyncio.FIRST_COMPLETED
            )
            done |= more
        assert len(done) == 7 and len(pending) == 1
        assert all(isinstance(t.exception(), CircuitOpenError) for t in done)
        await asyncio.to_thread(server.wait_for_hits, hits_before + 1)
        assert server.hits == hits_before + 1
        server.release()
        assert await pending.pop() == 200
        assert breaker.state is BreakerState.CLOSED
        server.set_mode("ok")
        assert await breaker.acall(fetch) == 200
    assert server.hits == hits_before + 2


def test_hanging_server_opens_then_recovery_closes(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """Client timeouts against a hanging server count as failures and open the
    breaker; once the server recovers, the single probe closes it."""
    breaker = make_breaker(clock, registry)
    server.set_mode("hang")
    for _ in range(3):
        with pytest.raises(TimeoutError):
            breaker.call(get, server.url)
    assert breaker.state is BreakerState.OPEN
    with pytest.raises(CircuitOpenError):
        breaker.call(get, server.url)
    assert server.hits == 3
    server.set_mode("ok")
    clock.advance(RESET_S)
    assert breaker.call(get, server.url) == 200
    assert breaker.state is BreakerState.CLOSED
    assert server.hits == 4


def test_failed_probe_reopens_for_a_full_timeout(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """A failing half-open probe reopens the breaker and restarts the reset timeout
    from the probe's failure."""
    breaker = make_breaker(clock, registry)
    trip(breaker, server)
    clock.advance(RESET_S + 5.0)
    with pytest.raises(urllib.error.HTTPError):
        breaker.call(get, server.url)
    assert breaker.state is BreakerState.OPEN
    assert breaker.retry_after_s() == pytest.approx(RESET_S)
    assert sample(
        registry, "trainguard_breaker_transitions_total",
        breaker="dep", from_state="half_open", to_state="open",
    ) == 1


def test_metrics_record_state_and_transitions(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """The state enum and the transition/call counters on the given registry follow
    closed -> open -> half_open -> closed exactly."""
    breaker = make_breaker(clock, registry)
    assert sample(registry, "trainguard_breaker_state", breaker="dep",
                  trainguard_breaker_state="closed") == 1
    trip(breaker, server)
    assert sample(registry, "trainguard_breaker_state", breaker="dep",
                  trainguard_breaker_state="open") == 1
    assert sample(registry, "trainguard_breaker_state", breaker="dep",
                  trainguard_breaker_state="closed") == 0
    server.set_mode("ok")
    clock.advance(RESET_S)
    breaker.call(get, server.url)
    transitions = {
        (frm, to): sample(registry, "trainguard_breaker_transitions_total",
                          breaker="dep", from_state=frm, to_state=to)
        for frm, to in [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]
    }
    assert transitions == {("closed", "open"): 1, ("open", "half_open"): 1,
                           ("half_open", "closed"): 1}
    assert sample(registry, "trainguard_breaker_calls_total", breaker="dep",
                  outcome="failure") == 3
    assert sample(registry, "trainguard_breaker_calls_total", breaker="dep",
                  outcome="success") == 1
    assert sample(registry, "trainguard_breaker_state", breaker="dep",
                  trainguard_breaker_state="closed") == 1


def test_stale_success_from_before_the_outage_does_not_close(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """A slow call admitted while closed that succeeds after the breaker opened is
    ignored: the breaker stays open."""
    breaker = make_breaker(clock, registry)
    server.set_mode("gate")
    slow: queue.Queue[int] = queue.Queue()
    t = threading.Thread(target=lambda: slow.put(breaker.call(get, server.url)))
    t.start()
    server.wait_for_hits(1)
    for _ in range(3):
        with pytest.raises(ZeroDivisionError):
            breaker.call(lambda: 1 / 0)
    assert breaker.state is BreakerState.OPEN
    server.release()
    assert slow.get(timeout=30) == 200
    t.join(30)
    assert breaker.state is BreakerState.OPEN


async def test_cancelled_probe_lets_the_next_caller_probe(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """A probe task that is cancelled decides nothing: the breaker stays half-open
    and the next caller becomes the probe (instead of being locked out forever)."""
    breaker = make_breaker(clock, registry)
    trip(breaker, server)
    clock.advance(RESET_S)
    server.set_mode("hang")
    async with aiohttp.ClientSession() as http:

        async def fetch() -> int:
            async with http.get(server.url) as resp:
                resp.raise_for_status()
                return resp.status

        probe = asyncio.create_task(breaker.acall(fetch))
        await asyncio.to_thread(server.wait_for_hits, 4)
        with pytest.raises(CircuitOpenError):
            await breaker.acall(fetch)
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        assert breaker.state is BreakerState.HALF_OPEN
        server.set_mode("ok")
        assert await breaker.acall(fetch) == 200
    assert breaker.state is BreakerState.CLOSED
    assert sample(registry, "trainguard_breaker_calls_total", breaker="dep",
                  outcome="abandoned") == 1


def test_non_failure_exceptions_count_as_answers(
    clock: ManualClock, registry: CollectorRegistry
) -> None:
    """Exceptions outside failure_exceptions, or in ignored_exceptions, are re-raised
    unchanged but do not count toward opening (the dependency answered)."""
    breaker = make_breaker(
        clock, registry, failure_exceptions=(OSError, LookupError),
        ignored_exceptions=(KeyError,),
    )
    for exc in (KeyError("k"), ValueError("v"), KeyError("k"), ValueError("v")):
        def raise_it(e: Exception = exc) -> None:
            raise e
        with pytest.raises(type(exc)):
            breaker.call(raise_it)
    assert breaker.state is BreakerState.CLOSED
    for _ in range(3):
        with pytest.raises(IndexError):
            breaker.call(lambda: [][0])
    assert breaker.state is BreakerState.OPEN


async def test_guard_and_decorator_share_the_breaker(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """`with guard()`, `async with guard()`, and `@protect` (sync and async) all
    count toward the same breaker and all fail fast once it is open."""
    breaker = make_breaker(clock, registry)
    server.set_mode("fail")

    @breaker.protect
    def sync_get() -> int:
        return get(server.url)

    @breaker.protect
    async def async_get() -> int:
        return await asyncio.to_thread(get, server.url)

    with pytest.raises(urllib.error.HTTPError):
        sync_get()
    with pytest.raises(urllib.error.HTTPError):
        await async_get()
    with pytest.raises(urllib.error.HTTPError), breaker.guard():
        get(server.url)
    assert breaker.state is BreakerState.OPEN
    with pytest.raises(CircuitOpenError):
        sync_get()
    with pytest.raises(CircuitOpenError):
        await async_get()
    with pytest.raises(CircuitOpenError):
        async with breaker.guard():
            pass
    assert server.hits == 3
    server.set_mode("ok")
    clock.advance(RESET_S)
    async with breaker.guard():
        await asyncio.to_thread(get, server.url)
    assert breaker.state is BreakerState.CLOSED


def test_invalid_configuration_is_refused() -> None:
    """Nonsense thresholds are refused at construction with the bad value named."""
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker("x", failure_threshold=0, registry=CollectorRegistry())
    with pytest.raises(ValueError, match="failure_rate_threshold"):
        CircuitBreaker("x", failure_rate_threshold=1.5, registry=CollectorRegistry())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_does_not_inherit_a_held_lock(
    clock: ManualClock, registry: CollectorRegistry
) -> None:
    """A fork while another thread is inside the breaker (its lock held) leaves the
    child with a working breaker (fresh lock, inherited state) instead of a deadlock."""
    breaker = make_breaker(clock, registry)
    with breaker._lock:
        pid = os.fork()
        if pid == 0:  # child: the parent's holder thread does not exist here
            code = 3
            try:
                ok = breaker.call(lambda: 7) == 7 and breaker.state is BreakerState.CLOSED
                code = 0 if ok else 1
            finally:
                os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child deadlocked on the breaker's lock")
    assert os.waitstatus_to_exitcode(status) == 0


async def test_acall_timeout_counts_hangs_as_failures(
    server: ControlledServer, clock: ManualClock, registry: CollectorRegistry
) -> None:
    """With acall_timeout_s, coroutines hanging on the server time out as failures and
    open the breaker; the client itself has no timeout at all."""
    breaker = make_breaker(clock, registry, acall_timeout_s=0.3)
    server.set_mode("hang")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:

        async def fetch() -> int:
            async with http.get(server.url) as resp:
                return resp.status

        for _ in range(3):
            with pytest.raises(TimeoutError):
                await breaker.acall(fetch)
        assert breaker.state is BreakerState.OPEN
        with pytest.raises(CircuitOpenError):
            await breaker.acall(fetch)
    assert server.hits == 3
    assert sample(registry, "trainguard_breaker_calls_total", breaker="dep",
                  outcome="failure") == 3
