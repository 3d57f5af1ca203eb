"""Push bodies decoded off the event loop, in the decode pool's worker processes,
against a real Redis and the real service (``trainguard serve`` for the kill -9).

Properties:
- a body of a million lists builds not one of them in the service's process (the
  worker decodes it), and its records land whole, once, in order; a small body is
  parsed on the loop and starts no worker;
- a decode worker killed -9 while it decodes: that push is 503 with ``Retry-After``
  and appends nothing, the service keeps serving, the pool starts another worker, and
  the same batch resent under the same seq lands once, whole;
- a decode past ``decode_timeout_s`` is 413 naming the limit, appends nothing, and
  the worker is killed and replaced;
- a pool whose workers are all busy and whose queue is full answers 503 busy with
  ``Retry-After`` instead of queueing, and appends nothing for that push.

Structure and process state only: no time is measured (the decode timeout is a
configured bound, not a measurement).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from ingest_service.datasets import create_dataset
from ingest_service.push import bounds as push_bounds
from ingest_service.push import entries as push_entries
from ingest_service.push.body import BodyLimits
from ingest_service.push.ingest import choose_partition
from ingest_service.service.app import create_app
from ingest_service.service.auth import PushTokens
from ingest_service.service.config import IngestConfig
from ingest_service.service.push_route import PUSH_KEY
from tests.servers import RedisServer, free_port
from tests.test_push_memory import _wait_ready
from trainguard.core import streams

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "decode-push-token-0123456789"
HEADERS = {"Content-Type": "application/msgpack", "Authorization": f"Bearer {TOKEN}"}
URL = "/v1/datasets/rl/records"
HEAVY = [[]] * 9_998
"""A record of 9,998 empty lists: within the bound of 10,000, about 4 ms to decode."""


def _heavy_body(records: int) -> bytes:
    return msgpack.packb([HEAVY] * records)


PARTITIONS = 8
"""w-0, w-1 and w-2 each have a partition of their own (4, 2, 0)."""


async def _dataset(url: str) -> Redis:
    r = Redis.from_url(url)
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=PARTITIONS, format="push"))
    assert len({choose_partition(f"w-{i}", PARTITIONS) for i in range(3)}) == 3
    return r


async def _stream(r: Redis, producer: str) -> list[Any]:
    key = streams.partition_key("rl", choose_partition(producer, PARTITIONS))
    return [streams.decode_record(f) for _, f in await r.xrange(key)]


@asynccontextmanager
async def _service(redis_server: RedisServer, **limits: Any) -> AsyncIterator[TestClient]:
    config = IngestConfig(redis_url=redis_server.url, produce=False,
                          push_tokens=PushTokens.parse(f"{TOKEN}:rl:w-*"),
                          push_limits=dataclasses.replace(BodyLimits(), **limits))
    async with TestClient(TestServer(create_app(config), host="127.0.0.1")) as client:
        yield client


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


async def _until_decoding(pid: int, ticks: int = 30) -> None:
    """Until worker ``pid`` has spent ``ticks`` more clock ticks of CPU (0.3 s at
    100 Hz): it is in the decode of the body sent to it (its reading is milliseconds)."""
    start = _cpu_ticks(pid)
    for _ in range(6000):
        if _cpu_ticks(pid) - start >= ticks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"worker {pid} did not start decoding within a minute")


async def test_a_body_of_a_million_lists_builds_none_of_them_in_the_service(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """100 records of 9,998 empty lists (999,800 lists, 1 MB): not one list hook nor
    record encoding runs in the service's process, and the 100 records land once, in
    order; then a small body (10 records of numbers) is parsed on the loop, its 10
    records encoded here."""
    r = await _dataset(redis_server.url)
    hooks: list[int] = []
    encodes: list[int] = []
    real_hook, real_encode = push_bounds.MsgpackBounds.list_hook, push_entries._encode

    def hook(self: push_bounds.MsgpackBounds, value: list[Any]) -> list[Any]:
        hooks.append(1)
        return real_hook(self, value)

    def encode(*args: Any) -> Any:
        encodes.append(1)
        return real_encode(*args)

    monkeypatch.setattr(push_bounds.MsgpackBounds, "list_hook", hook)
    monkeypatch.setattr(push_entries, "_encode", encode)
    async with _service(redis_server) as client:
        resp = await client.post(URL, params={"producer_id": "w-1", "seq": "0"},
                                 headers=HEADERS, data=_heavy_body(100))
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["count"] == 100
        assert hooks == [] and encodes == []
        assert client.app[PUSH_KEY].decoders.pids  # type: ignore[union-attr]
        small = msgpack.packb([[i, i + 1] for i in range(10)])
        resp = await client.post(URL, params={"producer_id": "w-2", "seq": "0"},
                                 headers=HEADERS, data=small)
        assert resp.status == 200, await resp.text()
        assert len(encodes) == 10
    assert await _stream(r, "w-1") == [HEAVY] * 100
    assert await _stream(r, "w-2") == [[i, i + 1] for i in range(10)]
    await r.aclose()


async def test_a_small_body_starts_no_worker(redis_server: RedisServer) -> None:
    """A body under inline_bytes with few lists is parsed on the loop: the pool has no
    worker after it."""
    r = await _dataset(redis_server.url)
    async with _service(redis_server) as client:
        resp = await client.post(URL, params={"producer_id": "w-1", "seq": "0"},
                                 headers=HEADERS, data=msgpack.packb([b"x" * 1000] * 50))
        assert resp.status == 200, await resp.text()
        assert client.app[PUSH_KEY].decoders.pids == []  # type: ignore[union-attr]
    assert len(await _stream(r, "w-1")) == 50
    await r.aclose()


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def _new_child(pid: int, old: int) -> int:
    for _ in range(600):
        fresh = [c for c in _children(pid) if c != old]
        if fresh:
            return fresh[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"the service started no decode worker after {old} died")


@pytest.mark.slow
def test_a_decode_worker_killed_mid_request_is_503_appends_nothing_and_is_replaced(
        redis_factory: Callable[..., RedisServer]) -> None:
    """With a real ``trainguard serve --decode-workers 1``: the worker is killed -9
    while it decodes seq 1 (800 records of 9,998 lists). That push is 503 with
    Retry-After and appends nothing; /healthz answers; another worker is started; the
    same batch resent under seq 1 is 200 with its 800 records, and the stream holds
    seq 0's record and seq 1's 800 records once each, in order."""
    server = redis_factory()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": server.url,
           "TRAINGUARD_PUSH_TOKENS": f"{TOKEN}:rl:w-*"}
    service = subprocess.Popen([sys.executable, "-m", "trainguard", "serve", "--port", str(port),
                                "--no-produce", "--decode-workers", "1", "--decode-timeout",
                                "600"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    body = _heavy_body(800)

    async def scenario() -> None:
        r = await _dataset(server.url)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await _wait_ready(session, base, service)

            async def push(seq: int, data: bytes) -> tuple[int, dict[str, str], Any]:
                async with session.post(f"{base}{URL}", data=data, headers=HEADERS,
                                        params={"producer_id": "w-1", "seq": str(seq)}) as resp:
                    return resp.status, dict(resp.headers), await resp.json()

            status, _, answer = await push(0, _heavy_body(1))  # the worker starts
            assert status == 200, answer
            [worker] = _children(service.pid)
            pending = asyncio.ensure_future(push(1, body))
            await _until_decoding(worker)
            os.kill(worker, signal.SIGKILL)
            status, headers, answer = await pending
            assert status == 503, answer
            assert "Retry-After" in headers
            assert "decode worker ended" in answer["error"]["message"]
            assert len(await _stream(r, "w-1")) == 1  # nothing of seq 1
            async with session.get(f"{base}/healthz") as resp:
                assert resp.status == 200
            assert service.poll() is None
            await _new_child(service.pid, worker)
            status, _, answer = await push(1, body)
            assert status == 200, answer
            assert answer["count"] == 800
            assert await _stream(r, "w-1") == [HEAVY] * 801
        await r.aclose()

    try:
        asyncio.run(scenario())
    finally:
        service.terminate()
        service.wait(60)


async def test_a_decode_past_its_timeout_is_413_appends_nothing_and_the_worker_is_replaced(
        redis_server: RedisServer) -> None:
    """decode_timeout_s 0.5 and a body of 800 records of 9,998 lists (seconds of
    decoding on any machine): 413 naming decode_timeout_s, nothing appended, the worker
    killed and reaped, and another one started in its place."""
    r = await _dataset(redis_server.url)
    async with _service(redis_server, decode_workers=1, decode_timeout_s=0.5) as client:
        pool = client.app[PUSH_KEY].decoders
        assert pool is not None
        pending = asyncio.ensure_future(client.post(
            URL, params={"producer_id": "w-1", "seq": "0"}, headers=HEADERS,
            data=_heavy_body(800)))
        while not pool.pids:  # the worker that takes the body
            assert not pending.done(), await (await pending).text()
            await asyncio.sleep(0.01)
        [first] = pool.pids
        resp = await pending
        assert resp.status == 413, await resp.text()
        assert "decode_timeout_s" in (await resp.json())["error"]["message"]
        assert await _stream(r, "w-1") == []
        for _ in range(6000):
            if pool.pids and first not in pool.pids:
                break
            await asyncio.sleep(0.01)
        assert pool.pids and first not in pool.pids
        for _ in range(600):
            try:
                os.kill(first, 0)
            except ProcessLookupError:
                break  # killed and reaped
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"worker {first} still exists")
    await r.aclose()


async def test_a_full_pool_is_503_busy_with_retry_after(redis_server: RedisServer) -> None:
    """One worker, no queue: while it decodes w-1's body, w-2's heavy body is 503 busy
    with Retry-After and appends nothing; w-1's lands whole, and w-2's resend lands."""
    r = await _dataset(redis_server.url)
    async with _service(redis_server, decode_workers=1, decode_queue=0,
                        decode_timeout_s=600) as client:
        pool = client.app[PUSH_KEY].decoders
        assert pool is not None
        resp = await client.post(URL, params={"producer_id": "w-0", "seq": "0"},
                                 headers=HEADERS, data=_heavy_body(1))
        assert resp.status == 200, await resp.text()
        [worker] = pool.pids
        first = asyncio.ensure_future(client.post(
            URL, params={"producer_id": "w-1", "seq": "0"}, headers=HEADERS,
            data=_heavy_body(800)))
        await _until_decoding(worker)
        resp = await client.post(URL, params={"producer_id": "w-2", "seq": "0"},
                                 headers=HEADERS, data=_heavy_body(2))
        assert resp.status == 503, await resp.text()
        assert resp.headers["Retry-After"]
        assert (await resp.json())["error"]["code"] == "busy"
        assert await _stream(r, "w-2") == []
        resp = await first
        assert resp.status == 200, await resp.text()
        resp = await client.post(URL, params={"producer_id": "w-2", "seq": "0"},
                                 headers=HEADERS, data=_heavy_body(2))
        assert resp.status == 200, await resp.text()
    assert await _stream(r, "w-1") == [HEAVY] * 800
    assert await _stream(r, "w-2") == [HEAVY] * 2
    await r.aclose()
