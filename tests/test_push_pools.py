"""The push route's pools under load, against the real service and a real Redis: a
burst of pushes queues for a bounded set of Redis connections that shrinks once idle;
one producer token cannot hold the whole body budget; a body trickled under the
minimum rate gives its room back (408)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from ingest_service.datasets import create_dataset
from ingest_service.push.body import BodyLimits
from ingest_service.service.app import create_app
from ingest_service.service.auth import PushTokens
from ingest_service.service.config import IngestConfig
from tests.servers import RedisServer
from trainguard.core import streams

T1 = "pool-token-one-0123456789"
T2 = "pool-token-two-0123456789"
NDJSON = {"Content-Type": "application/x-ndjson"}
URL = "/v1/datasets/{}/records"


@asynccontextmanager
async def service(redis_server: RedisServer, **kw: Any) -> AsyncIterator[TestClient]:
    config = IngestConfig(redis_url=redis_server.url, produce=False,
                          push_tokens=PushTokens.parse(f"{T1}:rl:a-*;{T2}:evals:b-*"), **kw)
    async with TestClient(TestServer(create_app(config), host="127.0.0.1")) as client:
        yield client


async def _datasets(r: Redis) -> None:
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=4, format="push"))
    await create_dataset(r, streams.DatasetSpec(name="evals", partitions=1, format="push"))


async def _clients(r: Redis) -> int:
    return int((await r.info("clients"))["connected_clients"])


async def test_a_burst_of_pushes_queues_for_a_bounded_pool_that_shrinks_when_idle(
        redis_server: RedisServer) -> None:
    """120 pushes at once from 120 producers, with a push pool of 12: every one is
    answered 200 and appended once, Redis never sees more than the pool's 12 links
    (beside the service's shared client), and once they are idle the pool closes them
    down to the 4 it keeps."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    baseline = await _clients(r)
    async with service(redis_server, push_pool_connections=12, push_pool_idle_s=0.2) as client:
        assert (await client.get("/readyz")).status == 200
        others = await _clients(r) - baseline  # the shared client's links (readyz, watch)
        peak = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, await _clients(r) - baseline - others)
                await asyncio.sleep(0)

        async def push(i: int) -> int:
            resp = await client.post(URL.format("rl"), params={"producer_id": f"a-{i}", "seq": "0"},
                                     headers={**NDJSON, "Authorization": f"Bearer {T1}"},
                                     data=b"".join(json.dumps({"i": i, "k": k}).encode() + b"\n"
                                                   for k in range(20)))
            return resp.status

        watcher = asyncio.create_task(watch())
        statuses = await asyncio.gather(*(push(i) for i in range(120)))
        done.set()
        await watcher
        assert statuses == [200] * 120
        assert peak <= 12 + 1, peak  # + 1: a shared-client link the probes may open
        assert sum([await r.xlen(streams.partition_key("rl", p)) for p in range(4)]) == 120 * 20
        for _ in range(500):  # the trim runs every 0.2 s
            if await _clients(r) - baseline - others <= 4:
                break
            await asyncio.sleep(0.02)
        assert await _clients(r) - baseline - others <= 4
    await r.aclose()


async def _start_push(port: int, token: str, dataset: str, producer: str, length: int,
                      start: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST /v1/datasets/{dataset}/records?producer_id={producer}&seq=0 HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\nContent-Type: application/x-ndjson\r\n"
        f"Authorization: Bearer {token}\r\nContent-Length: {length}\r\n\r\n".encode() + start)
    await writer.drain()
    return reader, writer


async def test_one_token_holds_at_most_its_share_of_the_body_budget(
        redis_server: RedisServer) -> None:
    """Budget 16,000 bytes, a token's share an eighth (2,000: two bodies of the 1,000-byte
    limit): token one's two unfinished bodies (900 of their declared 1,000 bytes sent;
    a declared body takes its whole room before it is read) leave its token no room for
    a third (503 busy naming the per-token bound), while token two's push to another
    dataset goes in (200)."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    limits = BodyLimits(max_bytes=1000, max_inflight_bytes=16_000, token_share=0.125)
    held = b'"' + b"x" * 898 + b"\n"  # 900 bytes of a 1,000-byte body
    async with service(redis_server, push_limits=limits) as client:
        writers = [(await _start_push(client.port, T1, "rl", f"a-{i}", 1000, held))[1]
                   for i in range(2)]
        for _ in range(1000):
            metrics = await (await client.get("/metrics")).text()
            if "trainguard_ingest_push_body_bytes 2000.0" in metrics:
                break
            await asyncio.sleep(0.01)
        assert "trainguard_ingest_push_body_bytes 2000.0" in metrics
        busy = await client.post(URL.format("rl"), params={"producer_id": "a-3", "seq": "0"},
                                 headers={**NDJSON, "Authorization": f"Bearer {T1}"},
                                 data=b'"' + b"y" * 300 + b'"\n')
        error = (await busy.json())["error"]
        assert busy.status == 503 and error["code"] == "busy", error
        assert "bound per token is 2000" in error["message"]
        other = await client.post(URL.format("evals"), params={"producer_id": "b-1", "seq": "0"},
                                  headers={**NDJSON, "Authorization": f"Bearer {T2}"},
                                  data=b'"' + b"z" * 300 + b'"\n')
        assert other.status == 200, await other.text()
        for writer in writers:
            writer.close()
    assert await r.xlen(streams.partition_key("evals", 0)) == 1
    await r.aclose()


async def test_a_body_under_the_minimum_rate_is_408_and_gives_its_room_back(
        redis_server: RedisServer) -> None:
    """A body sent 10 bytes at a time, each chunk well within the chunk timeout but
    the whole under the minimum rate (1,000 bytes/s after a 0.2 s grace), is answered
    408 naming the minimum rate, appends nothing, and holds no room afterwards."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    limits = BodyLimits(chunk_timeout_s=5.0, total_timeout_s=30.0, min_rate_bytes_s=1000,
                        min_rate_grace_s=0.2)
    async with service(redis_server, push_limits=limits) as client:
        reader, writer = await _start_push(client.port, T1, "rl", "a-1", 100_000, b"")
        answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        while not answer.done():
            writer.write(b"1234567,8\n")
            await writer.drain()
            await asyncio.wait([answer], timeout=0.05)
        head = answer.result()
        assert head.startswith(b"HTTP/1.1 408"), head
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await reader.readexactly(length)
        assert b"at least 1000 bytes/s" in body, body
        writer.close()
        metrics = await (await client.get("/metrics")).text()
        assert "trainguard_ingest_push_body_bytes 0.0" in metrics
    assert sum([await r.xlen(streams.partition_key("rl", p)) for p in range(4)]) == 0
    await r.aclose()
