"""Retries with backoff combined with the breaker, against a real redis-server."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio
import redis.exceptions
import stamina
from prometheus_client import CollectorRegistry

from tests._http_servers import ManualClock
from tests.servers import MotoServer, RedisServer
from trainer_client.redis_retry import aredis_call, redis_breaker, redis_call, redis_retrier
from trainguard.core.resilience import (
    CircuitOpenError,
    Retrier,
    RetryPolicy,
    object_store_breaker,
    object_store_retrier,
    retry_testing,
)
from trainguard.core.resilience.breaker import BreakerState, CircuitBreaker

FAST = RetryPolicy(attempts=None, timeout_s=120.0, wait_initial_s=0.01, wait_max_s=0.05,
                   wait_jitter_s=0.01)


@pytest.fixture
def waits() -> Iterator[list[float]]:
    """The backoff stamina chose before each retry, captured by a retry hook."""
    seen: list[float] = []
    stamina.instrumentation.set_on_retry_hooks([lambda details: seen.append(details.wait_for)])
    yield seen
    stamina.instrumentation.set_on_retry_hooks(None)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def restart_when_open(server: RedisServer, breaker: CircuitBreaker) -> threading.Thread:
    """Restart the killed Redis once the breaker has opened (the outage was seen)."""
    opened = threading.Event()

    def run() -> None:
        while breaker.state is not BreakerState.OPEN:
            opened.wait(0.01)
        server.restart()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_redis_outage_waits_and_recovers(redis_server: RedisServer) -> None:
    """With Redis killed, redis_call neither crashes nor gives up: the breaker opens,
    the caller waits, and once Redis is back the call returns its real answer and the
    breaker closes (closed -> open -> half_open -> closed on the metrics)."""
    registry = CollectorRegistry()
    breaker = redis_breaker("redis", failure_threshold=2, reset_timeout_s=0.1, registry=registry)
    client = redis.Redis.from_url(redis_server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    retrier = redis_retrier(breaker, FAST)
    assert retrier.call(client.set, "k", "v") is True
    redis_server.kill()
    restarter = restart_when_open(redis_server, breaker)
    # No persistence: the restarted server is empty, so the answer proves a real round trip.
    assert retrier.call(client.set, "k", "after") is True
    restarter.join(30)
    assert client.get("k") == b"after"
    assert breaker.state is BreakerState.CLOSED
    assert sample(registry, "trainguard_breaker_transitions_total", breaker="redis",
                  from_state="closed", to_state="open") >= 1
    assert sample(registry, "trainguard_breaker_transitions_total", breaker="redis",
                  from_state="half_open", to_state="closed") == 1
    client.close()


async def test_async_redis_outage_waits_and_recovers(redis_server: RedisServer) -> None:
    """The async twin on a redis.asyncio client survives a kill/restart: the call
    after the outage returns the fresh server's answer and the breaker ends closed."""
    registry = CollectorRegistry()
    breaker = redis_breaker("aredis", failure_threshold=2, reset_timeout_s=0.1,
                            registry=registry)
    client = redis.asyncio.Redis.from_url(redis_server.url, socket_timeout=1.0,
                                          socket_connect_timeout=1.0)
    assert await aredis_call(breaker, client.incr, "n") == 1
    retrier = redis_retrier(breaker, FAST)
    redis_server.kill()
    restarter = restart_when_open(redis_server, breaker)
    assert await retrier.acall(client.incr, "n") == 1  # fresh server
    restarter.join(30)
    assert breaker.state is BreakerState.CLOSED
    await client.aclose()


def test_open_breaker_is_waited_out_not_hammered(waits: list[float]) -> None:
    """While the breaker is open, each retry waits at least the breaker's remaining
    open time and the protected function is never called (no spinning, no traffic)."""
    clock = ManualClock()
    breaker = CircuitBreaker("dep", failure_threshold=1, reset_timeout_s=0.05, clock=clock,
                             registry=CollectorRegistry())
    with pytest.raises(ConnectionError):
        breaker.call(_raise_connection_error)
    calls: list[int] = []

    def fn() -> int:
        calls.append(1)
        return 1

    policy = RetryPolicy(attempts=3, timeout_s=None, wait_initial_s=0.01)
    with pytest.raises(CircuitOpenError):
        Retrier(on=(ConnectionError,), breaker=breaker, policy=policy).call(fn)
    assert calls == []
    assert len(waits) == 2
    assert all(0.05 <= w <= 0.06 for w in waits), waits


def test_response_errors_are_neither_retried_nor_failures(redis_server: RedisServer) -> None:
    """A Redis ResponseError (BUSYGROUP) means Redis is up: raised on the first try,
    and counted as a success by the breaker."""
    registry = CollectorRegistry()
    breaker = redis_breaker("redis", failure_threshold=1, registry=registry)
    client = redis.Redis.from_url(redis_server.url)
    redis_call(breaker, client.xgroup_create, "s", "g", id="0", mkstream=True)
    calls: list[int] = []

    def create_again() -> object:
        calls.append(1)
        return client.xgroup_create("s", "g", id="0")

    with pytest.raises(redis.exceptions.ResponseError, match="BUSYGROUP"):
        redis_call(breaker, create_again)
    assert calls == [1]
    assert breaker.state is BreakerState.CLOSED
    assert sample(registry, "trainguard_breaker_calls_total", breaker="redis",
                  outcome="success") == 2
    client.close()


def test_retry_testing_switches_backoff_off(waits: list[float]) -> None:
    """In retry_testing(attempts=2) a failing call is tried exactly twice, with zero
    backoff, then its error surfaces."""
    calls: list[int] = []

    def flaky() -> None:
        calls.append(1)
        raise ConnectionError("down")

    with retry_testing(attempts=2), pytest.raises(ConnectionError, match="down"):
        Retrier(on=(ConnectionError,), policy=RetryPolicy(attempts=10)).call(flaky)
    assert calls == [1, 1]
    assert waits == [0.0]
    assert not stamina.is_testing()


def test_policy_validation() -> None:
    """A policy that could never try is refused."""
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


def _raise_connection_error() -> None:
    raise ConnectionError("refused")


def test_object_store_outage_waits_and_recovers() -> None:
    """With the S3 endpoint (a real moto server) killed, a write through
    object_store_retrier neither crashes nor gives up: the breaker opens (s3fs raises
    botocore's EndpointConnectionError, not an OSError, and it still counts), and once
    S3 is back on the same port the write lands. A missing key is raised at once as
    FileNotFoundError and is no breaker failure."""
    import s3fs

    server = MotoServer().start()
    try:
        opts = {**server.storage_options(),
                "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2,
                                  "read_timeout": 5}}
        fs = s3fs.S3FileSystem(**opts)
        registry = CollectorRegistry()
        breaker = object_store_breaker("s3", failure_threshold=2, reset_timeout_s=0.2,
                                       registry=registry)
        retrier = object_store_retrier(breaker, FAST)

        def put(path: str, data: bytes) -> None:
            # Idempotent: the restarted moto is empty, so the bucket is made again.
            # (A plain CreateBucket: s3fs.mkdir sends a LocationConstraint that moto
            # refuses for us-east-1.)
            fs.invalidate_cache()
            if not fs.exists("ckpt"):
                fs.call_s3("create_bucket", Bucket="ckpt")
            fs.pipe_file(path, data)

        retrier.call(put, "ckpt/a", b"1")
        calls = 0

        def read_missing() -> bytes:
            nonlocal calls
            calls += 1
            return bytes(fs.cat_file("ckpt/missing"))

        with pytest.raises(FileNotFoundError):
            retrier.call(read_missing)
        assert calls == 1
        server.stop()
        reborn = MotoServer(port=server.port)
        opened = threading.Event()

        def restart() -> None:
            while breaker.state is not BreakerState.OPEN:
                opened.wait(0.01)
            reborn.start()

        restarter = threading.Thread(target=restart, daemon=True)
        restarter.start()
        retrier.call(put, "ckpt/b", b"2")
        restarter.join(60)
        assert fs.cat_file("ckpt/b") == b"2"
        assert breaker.state is BreakerState.CLOSED
        assert sample(registry, "trainguard_breaker_transitions_total", breaker="s3",
                      from_state="closed", to_state="open") >= 1
        reborn.stop()
    finally:
        server.stop()
