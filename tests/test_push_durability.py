"""Acknowledged pushes against a Redis that comes back older, or not at all, and
against kill -9 of the service and of Redis, with real processes throughout.

Properties, checked exactly over a ledger of what each producer was answered:
- Redis restarted from an older RDB snapshot under pushing producers: every
  acknowledged batch is either in the stream or reported lost by name (the producer's
  PushDataLostError lists its seq; /readyz and /v1/push/durability list the producer),
  none lost silently, none reported lost that is in, no record twice;
- Redis restarted without persistence: every acknowledged batch is reported lost;
- AOF on, the service and Redis each killed -9 under pushes: 0 acknowledged batches
  lost, 0 duplicated, and the service says Redis keeps acknowledged pushes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from ingest_service.datasets import create_dataset
from ingest_service.service.app import create_app
from ingest_service.service.auth import PushTokens
from ingest_service.service.config import IngestConfig
from tests.admin_helpers import ThreadedServer
from tests.servers import RedisServer, free_port
from trainguard.core import streams
from trainguard.push import Producer, PushDataLostError

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "durability-token-0123456789"
PRODUCERS = ("w-0", "w-1", "w-2")
BATCH = 10


def _create(url: str) -> None:
    async def create() -> None:
        from redis.asyncio import Redis as AsyncRedis

        r = AsyncRedis.from_url(url)
        await create_dataset(r, streams.DatasetSpec(name="rl", partitions=2, format="push"))
        await r.aclose()

    asyncio.run(create())


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def _stream_ns(url: str) -> dict[str, list[int]]:
    """Per producer, the record numbers in the dataset, in stream order."""
    r = Redis.from_url(url)
    out: dict[str, list[int]] = {w: [] for w in PRODUCERS}
    try:
        for p in range(2):
            for _, fields in r.xrange(streams.partition_key("rl", p)):
                record = streams.decode_record(fields)
                out[record["w"]].append(record["n"])
    finally:
        r.close()
    return out


class Ledger:
    """What each producer was answered: the batches acknowledged, in order, each with
    its seq, its record numbers and whether a PushDataLostError reported it lost
    since (a seq reported lost is used again by the producer's next batches); any
    other error."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: dict[str, list[tuple[int, list[int]]]] = {w: [] for w in PRODUCERS}
        self.reported: dict[str, set[int]] = {w: set() for w in PRODUCERS}
        """Indexes into ``acked`` of the batches reported lost."""
        self.errors: list[BaseException] = []

    def ack(self, name: str, seq: int, ns: list[int]) -> None:
        with self.lock:
            self.acked[name].append((seq, ns))

    def lost(self, name: str, seqs: range) -> None:
        with self.lock:
            self.reported[name].update(i for i, (seq, _) in enumerate(self.acked[name])
                                       if seq in seqs)

    def count(self, name: str) -> int:
        with self.lock:
            return len(self.acked[name])

    def wait(self, n: int, stop: threading.Event, timeout_s: float = 60) -> None:
        """Until every producer has ``n`` acknowledged batches (or one failed)."""
        deadline = time.monotonic() + timeout_s
        while any(self.count(w) < n for w in PRODUCERS):
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, {w: self.count(w) for w in PRODUCERS}
            time.sleep(0.02)

    def check(self, present: dict[str, list[int]]) -> dict[str, set[int]]:
        """Asserts the properties; returns, per producer, the indexes of the
        acknowledged batches that are not in."""
        assert not self.errors, self.errors
        lost: dict[str, set[int]] = {}
        for w in PRODUCERS:
            ns = present[w]
            assert len(ns) == len(set(ns)), f"{w}: a record twice"
            have = set(ns)
            whole = {i for i, (_, batch) in enumerate(self.acked[w]) if set(batch) <= have}
            missing = set(range(len(self.acked[w]))) - whole
            silent = sorted(self.acked[w][i][0] for i in missing - self.reported[w])
            assert not silent, f"{w}: acknowledged, absent, not reported: seqs {silent}"
            wrong = sorted(self.acked[w][i][0] for i in self.reported[w] & whole)
            assert not wrong, f"{w}: reported lost but in: seqs {wrong}"
            lost[w] = missing
        return lost


def _producers(base: str, ledger: Ledger, stop: threading.Event) -> list[threading.Thread]:
    def produce(name: str) -> None:
        n = 0
        try:
            with Producer(base, "rl", name, token=TOKEN, backoff_s=0.02, max_backoff_s=0.2,
                          max_attempts=500) as p:
                while not stop.is_set():
                    records = [{"w": name, "n": n + i} for i in range(BATCH)]
                    n += BATCH
                    try:
                        reply = p.send(records)
                    except PushDataLostError as exc:
                        ledger.lost(name, exc.lost_seqs)
                        continue
                    ledger.ack(name, reply.seq, [r["n"] for r in records])
                    time.sleep(0.005)
        except BaseException as exc:  # reported by the test
            ledger.errors.append(exc)

    threads = [threading.Thread(target=produce, args=(w,), daemon=True) for w in PRODUCERS]
    for t in threads:
        t.start()
    return threads


@pytest.fixture
def in_process(redis_server: RedisServer) -> Iterator[str]:
    _create(redis_server.url)
    config = IngestConfig(redis_url=redis_server.url, produce=False, durability_interval_s=0.1,
                          push_tokens=PushTokens.parse(f"{TOKEN}:rl:w-*"))
    server = ThreadedServer(create_app(config)).start()
    try:
        yield server.url
    finally:
        server.stop()


def test_redis_back_from_an_older_snapshot_every_acked_batch_is_in_or_reported_lost(
        in_process: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Three producers push; Redis saves an RDB snapshot; they push ten more batches
    each; Redis is killed -9 and restarts from the snapshot. Every batch acknowledged
    is in the stream or was reported lost to its producer by seq, and /readyz names
    the dataset and each producer that lost some under lost_acknowledged_data."""
    caplog.set_level(logging.ERROR, "ingest_service")
    ledger, stop = Ledger(), threading.Event()
    threads = _producers(in_process, ledger, stop)
    try:
        ledger.wait(5, stop)
        Redis.from_url(redis_server.url).save()
        at_save = {w: ledger.count(w) for w in PRODUCERS}
        ledger.wait(max(at_save.values()) + 10, stop)
        redis_server.kill()
        redis_server.start()
        after = {w: ledger.count(w) for w in PRODUCERS}
        ledger.wait(max(after.values()) + 3, stop)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    lost = ledger.check(_stream_ns(redis_server.url))
    losers = {w for w, seqs in lost.items() if seqs}
    assert losers == set(PRODUCERS)  # each pushed ten batches after the snapshot
    ready = _get(f"{in_process}/readyz")
    assert ready["ready"] is True
    assert set(ready["lost_acknowledged_data"]["rl"]["producers"]) == losers
    assert ready["durability"]["acknowledged_pushes_survive_restart"] is False
    assert _get(f"{in_process}/v1/push/durability")["lost_acknowledged_data"] == \
        ready["lost_acknowledged_data"]
    assert any("Redis lost acknowledged pushes" in r.getMessage() for r in caplog.records
               if r.levelno == logging.ERROR)


def test_redis_back_empty_every_acked_batch_is_reported_lost(
        in_process: str, redis_server: RedisServer) -> None:
    """Without persistence a restarted Redis holds nothing: the producer's next send
    raises PushDataLostError naming every seq it had acknowledged (not 'another
    process'), and /readyz marks the dataset lost_acknowledged_data."""
    with Producer(in_process, "rl", "w-0", token=TOKEN, backoff_s=0.02) as p:
        for b in range(4):
            p.send([{"w": "w-0", "n": b}])
        redis_server.kill()
        redis_server.start()
        with pytest.raises(PushDataLostError) as caught:
            p.send([{"w": "w-0", "n": 4}])
    assert list(caught.value.lost_seqs) == [0, 1, 2, 3]
    assert "Redis lost them" in str(caught.value)
    ready = _get(f"{in_process}/readyz")
    assert "rl" in ready["lost_acknowledged_data"]


def _serve(redis_url: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": redis_url,
           "TRAINGUARD_PUSH_TOKENS": f"{TOKEN}:rl:w-*"}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "serve", "--port", str(port),
                             "--no-produce"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            if _get(f"http://127.0.0.1:{port}/readyz")["ready"]:
                return proc
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)


def test_kill_9_of_the_service_and_of_redis_with_aof_loses_and_duplicates_nothing(
        redis_factory: Callable[..., RedisServer]) -> None:
    """AOF on (everysec): under three pushing producers, the service is killed -9 and
    started again, then Redis is killed -9 and started again. Every acknowledged batch
    is in the stream, each record once; nothing is reported lost, and the service
    says Redis keeps acknowledged pushes (AOF)."""
    server = redis_factory(persistence="everysec")
    _create(server.url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    service = _serve(server.url, port)
    ledger, stop = Ledger(), threading.Event()
    threads = _producers(base, ledger, stop)
    try:
        ledger.wait(5, stop)
        service.kill()
        service.wait()
        service = _serve(server.url, port)
        ledger.wait(max(ledger.count(w) for w in PRODUCERS) + 5, stop)
        server.kill()
        server.start()
        ledger.wait(max(ledger.count(w) for w in PRODUCERS) + 5, stop)
        ready = _get(f"{base}/readyz")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        service.kill()
        service.wait()
    lost = ledger.check(_stream_ns(server.url))
    assert lost == {w: set() for w in PRODUCERS}
    assert ledger.reported == {w: set() for w in PRODUCERS}
    assert ready["durability"]["acknowledged_pushes_survive_restart"] is True
    assert ready["durability"]["aof"] is True
    assert ready["lost_acknowledged_data"] == {}
