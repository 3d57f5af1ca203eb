"""A soak of the push edge (``-m chaos``): ten minutes of mixed push, admin and
consumer load against ``trainguard serve`` with Redis killed -9 and restarted twice.

Properties, checked exactly at the end:
- every record of every batch a producer had acknowledged is in the dataset once
  (0 lost, 0 duplicated), in each producer's order;
- no answer of the service was a 5xx other than the 503s of the Redis outages;
- the service's RSS stays flat: its mean over the last tenth of the run is within 10%
  of its mean over the second tenth (after warm-up).

``TRAINGUARD_SOAK_S`` shortens or lengthens the run (default 600 s).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.servers import RedisServer, free_port
from trainguard.core import streams
from trainguard.push import Producer

ROOT = Path(__file__).resolve().parent.parent
PUSH_TOKEN = "soak-producer-token-0123456"
ADMIN_TOKEN = "soak-admin-token-0123456789"
DATASET, GROUP, PRODUCERS, BATCH = "rl", "soak", 6, 50
DURATION_S = float(os.environ.get("TRAINGUARD_SOAK_S", "600"))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Statuses:
    def __init__(self) -> None:
        self.counts: collections.Counter[int] = collections.Counter()
        self.lock = threading.Lock()

    def add(self, status: int) -> None:
        with self.lock:
            self.counts[status] += 1


class CountingProducer(Producer):
    """The client as shipped, with every HTTP status it receives counted."""

    statuses: Statuses

    def _post(self, seq, body):  # type: ignore[no-untyped-def]
        status, payload, retry_after = super()._post(seq, body)
        self.statuses.add(status)
        return status, payload, retry_after


def _redis_retry(fn: Callable[[], object], stop: threading.Event) -> object:
    while not stop.is_set():
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            time.sleep(0.2)
    return None


@pytest.mark.chaos
@pytest.mark.timeout(DURATION_S + 300)
def test_push_soak_with_redis_restarts(redis_factory: Callable[..., RedisServer]) -> None:
    duration = DURATION_S
    server = redis_factory(persistence="always")
    async def create() -> None:
        from redis.asyncio import Redis

        from ingest_service.datasets import create_dataset

        client = Redis.from_url(server.url)
        await create_dataset(client, streams.DatasetSpec(name=DATASET, partitions=4, format="push"))
        await client.aclose()

    asyncio.run(create())
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": server.url,
           "TRAINGUARD_PUSH_TOKENS": f"{PUSH_TOKEN}:{DATASET}:w-*",
           "TRAINGUARD_ADMIN_TOKEN": ADMIN_TOKEN}
    service = subprocess.Popen([sys.executable, "-m", "trainguard", "serve", "--port", str(port),
                                "--no-produce"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    stop = threading.Event()
    statuses = Statuses()
    acked: dict[str, int] = {}
    consumed: dict[str, list[int]] = collections.defaultdict(list)
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                stop.set()
        return run

    def produce(name: str) -> None:
        p = CountingProducer(base, DATASET, name, token=PUSH_TOKEN, backoff_s=0.05,
                             max_attempts=1000)
        p.statuses = statuses
        sent = 0
        while not stop.is_set():
            p.send([{"w": name, "n": sent + i} for i in range(BATCH)])
            sent += BATCH
            acked[name] = sent
            time.sleep(0.02)
        p.close()

    def consume() -> None:
        # A reader the way a trainer reads: one group, commits published so that the
        # service's backlog advances and retention trims below the floor.
        c = redis.Redis.from_url(server.url, socket_timeout=5)
        keys = [streams.partition_key(DATASET, p) for p in range(4)]
        for key in keys:
            _redis_retry(lambda key=key: c.xgroup_create(key, GROUP, id="0-0", mkstream=True), stop)
        _redis_retry(lambda: c.sadd(streams.groups_key(DATASET), GROUP), stop)
        recorded: dict[bytes, tuple[int, int]] = {}
        pending = True  # after a start or a lost reply: what was delivered but not acked
        while not stop.is_set():
            try:
                reply = c.xreadgroup(GROUP, "c1", {k: "0" if pending else ">" for k in keys},
                                     count=500, block=None if pending else 200)
                pending = False
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pending = True
                time.sleep(0.2)
                continue
            for key, entries in reply or []:
                if not entries:
                    continue
                for entry_id, fields in entries:
                    parsed = streams.parse_id(entry_id)
                    if parsed <= recorded.get(key, (0, 0)):
                        continue  # recorded already; its ack was lost
                    recorded[key] = parsed
                    value = streams.decode_record(fields)
                    consumed[value["w"]].append(value["n"])
                p = str(keys.index(key.decode()))
                ids = [e[0] for e in entries]
                _redis_retry(functools.partial(c.xack, key, GROUP, *ids), stop)
                for hkey in (streams.committed_key(DATASET, GROUP), streams.floor_key(DATASET, GROUP)):
                    _redis_retry(functools.partial(c.hset, hkey, p, ids[-1]), stop)
        c.close()

    def admin() -> None:
        paths = ["/admin/datasets", f"/admin/datasets/{DATASET}", f"/admin/datasets/{DATASET}/groups",
                 "/metrics", "/readyz", "/healthz"]
        while not stop.is_set():
            for path in paths:
                req = urllib.request.Request(base + path,
                                             headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
                try:
                    with urllib.request.urlopen(req, timeout=10) as resp:
                        statuses.add(resp.status)
                except urllib.error.HTTPError as exc:
                    statuses.add(exc.code)
            time.sleep(0.2)

    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/readyz", timeout=2)
            break
        except OSError:
            assert service.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    threads = [threading.Thread(target=guarded(lambda n=n: produce(f"w-{n}")))
               for n in range(PRODUCERS)]
    threads += [threading.Thread(target=guarded(consume)), threading.Thread(target=guarded(admin))]
    for t in threads:
        t.start()
    rss: list[tuple[float, float]] = []
    start = time.monotonic()
    restarts = [start + duration * 0.3, start + duration * 0.65]
    try:
        while time.monotonic() - start < duration and not stop.is_set():
            time.sleep(1.0)
            now = time.monotonic()
            rss.append((now - start, _rss_mb(service.pid)))
            if restarts and now >= restarts[0]:
                restarts.pop(0)
                server.kill()
                time.sleep(2.0)  # an outage the producers must ride out
                server.restart()
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        service.terminate()
        service.wait(60)
    assert not errors, errors
    # 0 lost, 0 duplicated: what the consumer read, then what is left after the group's
    # position, is exactly 0..acked-1 of each producer, in order.
    r = redis.Redis.from_url(server.url)
    for p in range(4):
        key = streams.partition_key(DATASET, p)
        (group,) = r.xinfo_groups(key)
        for _, fields in r.xrange(key, min="(" + group["last-delivered-id"].decode()):
            value = streams.decode_record(fields)
            consumed[value["w"]].append(value["n"])
    r.close()
    assert set(acked) == {f"w-{n}" for n in range(PRODUCERS)}
    for name, count in acked.items():
        assert consumed[name] == list(range(count)), (name, count, len(consumed[name]))
    print(f"soak {duration:.0f} s: {sum(acked.values()):,} records acknowledged by "
          f"{PRODUCERS} producers, statuses {dict(sorted(statuses.counts.items()))}, RSS "
          f"{min(m for _, m in rss):.0f}-{max(m for _, m in rss):.0f} MB")
    bad = {s: n for s, n in statuses.counts.items() if s >= 500 and s != 503}
    assert not bad, statuses.counts
    assert statuses.counts[200] > 0
    warm = [m for t, m in rss if 0.1 * duration <= t < 0.2 * duration]
    last = [m for t, m in rss if t >= 0.9 * duration]
    assert warm and last
    assert abs(sum(last) / len(last) - sum(warm) / len(warm)) <= 0.1 * sum(warm) / len(warm), (
        sum(warm) / len(warm), sum(last) / len(last))
