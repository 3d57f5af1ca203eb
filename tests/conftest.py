"""Shared fixtures: real redis-server processes and a real moto S3 server.

``redis_factory(persistence=...)`` starts a redis-server on a free port in its own
temporary directory; the server object has ``url``, ``kill()`` (SIGKILL),
``restart()`` (same port and data) and ``stop()``. Every server a test starts is reaped
when the test ends, passed or failed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.servers import MotoServer, RedisCluster, RedisServer

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    started: list[RedisServer] = []
    counter = itertools.count()

    def start(*, persistence: str = "none") -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{next(counter)}", persistence=persistence)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.kill()


@pytest.fixture
def redis_server(redis_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh redis-server without persistence."""
    return redis_factory()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer().start()
    yield server
    server.stop()


_buckets = itertools.count()


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> str:
    """A fresh, empty bucket on the moto server; returns its name."""
    return moto_server.create_bucket(f"tg-test-{os.getpid()}-{next(_buckets)}")


@pytest.fixture(scope="session")
def _shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(_shared_cluster: RedisCluster) -> RedisCluster:
    """A Redis Cluster (3 masters, 3 replicas), emptied for this test. Shared by the
    tests of a session, because starting one costs seconds: a test that kills nodes
    uses ``redis_cluster_factory`` instead."""
    _shared_cluster.wait_healthy()
    _shared_cluster.flushall()
    return _shared_cluster


@pytest.fixture
def redis_cluster_factory(tmp_path: Path) -> Iterator[Callable[[], RedisCluster]]:
    """Starts a Redis Cluster of this test's own, killed when the test ends."""
    started: list[RedisCluster] = []

    def start() -> RedisCluster:
        cluster = RedisCluster(tmp_path / f"cluster-{len(started)}")
        started.append(cluster)
        return cluster.start()

    yield start
    for cluster in started:
        cluster.stop()


@pytest.fixture(params=["single", "cluster"])
def any_redis(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    """The test runs twice: on one redis-server, and on a Redis Cluster. Both have
    ``url``, which is all the parts are given."""
    if request.param == "single":
        return request.getfixturevalue("redis_server")  # type: ignore[no-any-return]
    return request.getfixturevalue("redis_cluster")  # type: ignore[no-any-return]


@pytest.fixture(params=["single", pytest.param("cluster", marks=pytest.mark.chaos)])
def redis_target(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    """Like ``any_redis``, but the cluster leg runs only under ``-m chaos``: the rest of
    the integration tests, beyond the representative subset that runs on both by
    default (``any_redis``), which the 2-core CI budget does not take twice."""
    if request.param == "single":
        return request.getfixturevalue("redis_server")  # type: ignore[no-any-return]
    return request.getfixturevalue("redis_cluster")  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _no_rendezvous_env_leaks() -> Iterator[None]:
    """A rendezvous handler run in this process (the backend's tests) puts the variables
    its workers would inherit into os.environ: restore them after every test, so that no
    later test's trainers inherit a finished test's rendezvous (its Redis is gone)."""
    names = ("TRAINGUARD_RDZV_WORKER", "TRAINGUARD_RDZV_CLOSED_AT")
    saved = {n: os.environ.get(n) for n in names}
    yield
    for n, v in saved.items():
        if v is None:
            os.environ.pop(n, None)
        else:
            os.environ[n] = v


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh directory in shared memory, removed afterwards (it outlives processes)."""
    from checkpoint_store.ram_tier import memory_backed

    if memory_backed("/dev/shm") is None:
        pytest.skip("/dev/shm is not a memory-backed file system here")
    path = Path("/dev/shm") / f"trainguard-test-{uuid.uuid4().hex}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
