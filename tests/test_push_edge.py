"""The push edge, round two, against the real service and a real Redis: no record
freezes the event loop (a bomb of millions of empty lists is refused while it is
decoded), and no batch resent under a partly appended seq is merged or dropped
(409 batch_mismatch; the client resends its unacknowledged batch whole)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestClient, TestServer
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from ingest_service.datasets import create_dataset
from ingest_service.push.ingest import choose_partition
from ingest_service.service.app import create_app
from ingest_service.service.auth import PushTokens
from ingest_service.service.config import IngestConfig
from tests.admin_helpers import TOKEN as ADMIN_TOKEN
from tests.admin_helpers import ThreadedServer
from tests.servers import RedisServer
from trainguard.core import streams
from trainguard.push import Producer, PushError

TOKEN = "edge-push-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
URL = "/v1/datasets/{}/records"
BOMB = [[[]] * 10_000] * 419
"""One record of 4,190,000 empty lists: 4 MiB of msgpack."""


def _config(redis_server: RedisServer) -> IngestConfig:
    return IngestConfig(redis_url=redis_server.url, produce=False,
                        push_tokens=PushTokens.parse(f"{TOKEN}:big:actor-*"))


@asynccontextmanager
async def service(redis_server: RedisServer) -> AsyncIterator[TestClient]:
    os.environ["TRAINGUARD_ADMIN_TOKEN"] = ADMIN_TOKEN
    try:
        app = create_app(_config(redis_server))
    finally:
        del os.environ["TRAINGUARD_ADMIN_TOKEN"]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


async def _big(r: Redis) -> None:
    # Records up to 16 MiB: the bomb's re-encoded size passes max_record_bytes.
    await create_dataset(r, streams.DatasetSpec(name="big", partitions=2, format="push"))


class _Collections:
    """Counts the garbage collector's young-generation passes: one per 700 container
    objects the process allocates (net), so what a request built, in objects."""

    def __init__(self) -> None:
        self.young = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 0:
            self.young += 1

    def __enter__(self) -> _Collections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


BOMBS = [
    ("msgpack", "application/msgpack", msgpack.packb([BOMB])),
    ("json", "application/json", json.dumps([BOMB[:100]], separators=(",", ":")).encode()),
    ("ndjson", "application/x-ndjson", json.dumps(BOMB[:100], separators=(",", ":")).encode()
     + b"\n"),
]


@pytest.mark.parametrize(("kind", "content_type", "body"), BOMBS, ids=[b[0] for b in BOMBS])
async def test_a_bomb_record_is_413_with_the_limit_refused_while_decoding(
        redis_server: RedisServer, kind: str, content_type: str, body: bytes) -> None:
    """A record of millions (JSON: a million) of empty lists is answered 413 naming the
    limit (max_record_containers), appends nothing, and is refused after at most the
    limit's worth of containers were built: the service allocated a few tens of
    thousands of objects for it, not the bomb's millions (so no request waited behind
    its decode: there was none). /healthz answers throughout."""
    r = Redis.from_url(redis_server.url)
    await _big(r)
    async with service(redis_server) as client:
        order: list[str] = []

        async def push() -> None:
            with _Collections() as collections:
                resp = await client.post(URL.format("big"),
                                         params={"producer_id": "actor-1", "seq": "0"},
                                         headers={"Content-Type": content_type, **AUTH}, data=body)
                error = (await resp.json())["error"]
            assert resp.status == 413, error
            assert error["code"] == "too_large"
            assert "max_record_containers" in error["message"]
            assert "10000" in error["message"]
            # At most 10,000 lists per record decoded, then refused: each young pass is
            # 700 objects; the bomb holds 4,190,000 (JSON: 1,000,000) lists.
            assert collections.young * 700 < 200_000, collections.young
            order.append("push")

        async def probe() -> None:
            async with ClientSession() as session:
                while "push" not in order:
                    async with session.get(client.make_url("/healthz")) as resp:
                        assert resp.status == 200
                    order.append("healthz")
                    await asyncio.sleep(0)

        await asyncio.gather(push(), probe())
        assert "healthz" in order
    assert sum([await r.xlen(streams.partition_key("big", p)) for p in range(2)]) == 0
    await r.aclose()


async def test_nesting_past_the_depth_limit_is_413_with_the_limit(redis_server: RedisServer) -> None:
    """A record nested 65 deep (the limit is 64) is 413 naming max_record_depth, in
    msgpack and in JSON; one nested 64 deep is appended."""
    r = Redis.from_url(redis_server.url)
    await _big(r)
    deep: list[Any] = []
    for _ in range(64):
        deep = [deep]  # 65 lists, one in the other
    async with service(redis_server) as client:
        for content_type, body in (("application/msgpack", msgpack.packb([deep])),
                                   ("application/json", json.dumps([deep]).encode())):
            resp = await client.post(URL.format("big"), params={"producer_id": "actor-1", "seq": "0"},
                                     headers={"Content-Type": content_type, **AUTH}, data=body)
            error = (await resp.json())["error"]
            assert resp.status == 413 and "max_record_depth" in error["message"], error
        resp = await client.post(URL.format("big"), params={"producer_id": "actor-1", "seq": "0"},
                                 headers={"Content-Type": "application/msgpack", **AUTH},
                                 data=msgpack.packb([deep[0]]))
        assert resp.status == 200, await resp.text()
    await r.aclose()


# ---------------------------------------------------------------- batch mismatch

SMALL = 2_000
BIG_RECORD = 1_500_000
"""Over Redis' proto-max-bulk-len of 1 MB: the slice holding it breaks the connection."""


def _batch(tag: str, n: int, big_at: int | None = None) -> list[bytes]:
    return [b"x" * BIG_RECORD if i == big_at else f"{tag}-{i}".encode().ljust(SMALL, b".")
            for i in range(n)]


def _stream(url: str, producer: str) -> list[bytes]:
    r = SyncRedis.from_url(url)
    try:
        key = streams.partition_key("big", choose_partition(producer, 2))
        return [streams.decode_record(f) for _, f in r.xrange(key)]
    finally:
        r.close()


def _break_big_commands(url: str, broken: bool) -> None:
    """Redis refuses (and drops the connection of) any argument over 1 MB, or not."""
    r = SyncRedis.from_url(url)
    try:
        r.config_set("proto-max-bulk-len", "1mb" if broken else "512mb")
    finally:
        r.close()


async def _crash_part_way(client: TestClient, redis_server: RedisServer, batch: list[bytes]
                          ) -> None:
    """Batch A sent under seq 0 while Redis drops the connection at its second slice
    (record 256 is over Redis' bulk limit): the first 256 records are in, the rest not,
    and the push is answered 503 (not acknowledged). (Another producer's push first,
    so that Redis has the append script: else the first slice is a NOSCRIPT.)"""
    resp = await client.post(URL.format("big"), params={"producer_id": "actor-4", "seq": "0"},
                             headers={"Content-Type": "application/msgpack", **AUTH},
                             data=msgpack.packb([b"warm"]))
    assert resp.status == 200
    _break_big_commands(redis_server.url, True)
    resp = await client.post(URL.format("big"), params={"producer_id": "actor-1", "seq": "0"},
                             headers={"Content-Type": "application/msgpack", **AUTH},
                             data=msgpack.packb(batch))
    assert resp.status == 503, await resp.text()
    assert _stream(redis_server.url, "actor-1") == batch[:256]


@pytest.mark.parametrize("other", [700, 100])
async def test_another_batch_under_a_partly_appended_seq_is_409_batch_mismatch(
        redis_server: RedisServer, other: int) -> None:
    """Batch A (700 records) is partly in under seq 0 (256 records, the service lost
    its link to Redis at the second slice). A different batch B under seq 0 (700
    records, as A; or 100, fewer than are in) is answered 409 batch_mismatch naming
    what is in, and appends nothing; A resent whole is then completed: the stream holds
    A exactly, once, in order."""
    r = Redis.from_url(redis_server.url)
    await _big(r)
    a = _batch("a", 700, big_at=256)
    async with service(redis_server) as client:
        await _crash_part_way(client, redis_server, a)
        b = _batch("b", other)
        resp = await client.post(URL.format("big"), params={"producer_id": "actor-1", "seq": "0"},
                                 headers={"Content-Type": "application/msgpack", **AUTH},
                                 data=msgpack.packb(b))
        error = (await resp.json())["error"]
        assert resp.status == 409 and error["code"] == "batch_mismatch", error
        assert error["appended"] == 256 and error["count"] == 700
        assert _stream(redis_server.url, "actor-1") == a[:256]
        _break_big_commands(redis_server.url, False)
        resp = await client.post(URL.format("big"), params={"producer_id": "actor-1", "seq": "0"},
                                 headers={"Content-Type": "application/msgpack", **AUTH},
                                 data=msgpack.packb(a))
        reply = await resp.json()
        assert resp.status == 200 and reply["appended"] and reply["count"] == 444, reply
    assert _stream(redis_server.url, "actor-1") == a
    await r.aclose()


@pytest.fixture
def served(redis_server: RedisServer) -> Iterator[str]:
    async def setup() -> None:
        r = Redis.from_url(redis_server.url)
        await _big(r)
        await r.aclose()

    asyncio.run(setup())
    server = ThreadedServer(create_app(_config(redis_server))).start()
    try:
        yield server.url
    finally:
        server.stop()


def test_producer_resends_its_unacknowledged_batch_whole_before_new_records(
        served: str, redis_server: RedisServer) -> None:
    """Producer.send(A) raises PushError (Redis dropped the link at A's second slice,
    every attempt: 256 records of A in). The next send(C) first resends A whole under
    seq 0, then sends C under seq 1: the stream holds A then C, each once, and nothing
    of C was merged into A."""
    a = _batch("a", 700, big_at=256)
    c = _batch("c", 50)
    with Producer(served, "big", "actor-4", token=TOKEN) as warm:
        warm.send([b"warm"])  # Redis has the append script now
    _break_big_commands(redis_server.url, True)
    with Producer(served, "big", "actor-1", token=TOKEN, max_attempts=2, backoff_s=0.01) as p:
        with pytest.raises(PushError, match="not acknowledged"):
            p.send(a)
        assert p.pending == 0
        assert _stream(redis_server.url, "actor-1") == a[:256]
        _break_big_commands(redis_server.url, False)
        reply = p.send(c)
        assert (reply.seq, reply.appended, reply.count) == (1, True, 50)
        assert p.pending is None and p.next_seq == 2
    assert _stream(redis_server.url, "actor-1") == a + c


def test_a_producer_whose_resend_fails_again_takes_no_new_records(
        served: str, redis_server: RedisServer) -> None:
    """While its unacknowledged batch cannot be completed, send(new) raises before
    sending the new records: nothing of them is in, and the batch stays pending."""
    a = _batch("a", 700, big_at=256)
    with Producer(served, "big", "actor-4", token=TOKEN) as warm:
        warm.send([b"warm"])
    _break_big_commands(redis_server.url, True)
    with Producer(served, "big", "actor-1", token=TOKEN, max_attempts=2, backoff_s=0.01) as p:
        for _ in range(2):
            with pytest.raises(PushError):
                p.send(a if p.pending is None else _batch("new", 3))
        assert p.pending == 0
    assert _stream(redis_server.url, "actor-1") == a[:256]


async def _push(client: TestClient, producer: str, seq: int, batch: list[bytes]
                ) -> tuple[int, dict[str, Any]]:
    resp = await client.post(URL.format("big"), params={"producer_id": producer,
                                                        "seq": str(seq)},
                             headers={"Content-Type": "application/msgpack", **AUTH},
                             data=msgpack.packb(batch))
    return resp.status, await resp.json()


@pytest.mark.parametrize("other", [3, 50])
async def test_another_batch_under_the_last_complete_seq_is_409_and_the_same_one_200(
        redis_server: RedisServer, other: int) -> None:
    """Batches A (seq 0) and B (seq 1) are complete. A different batch C under seq 1
    (fewer records than B, or as many) is answered 409 batch_mismatch naming B's count,
    and appends nothing; B itself resent under seq 1 is 200 appended:false (a retry),
    also after a service restart; C under seq 2 is then appended: the stream holds A, B,
    C, each once, in order."""
    r = Redis.from_url(redis_server.url)
    await _big(r)
    a, b, c = _batch("a", 10), _batch("b", 50), _batch("c", other)
    async with service(redis_server) as client:
        assert (await _push(client, "actor-1", 0, a))[0] == 200
        assert (await _push(client, "actor-1", 1, b))[0] == 200
        status, reply = await _push(client, "actor-1", 1, c)
        assert status == 409 and reply["error"]["code"] == "batch_mismatch", reply
        assert reply["error"]["count"] == 50 and "next seq, 2" in reply["error"]["message"]
        assert _stream(redis_server.url, "actor-1") == a + b
        status, reply = await _push(client, "actor-1", 1, b)
        assert status == 200 and not reply["appended"] and reply["mark"] == 1, reply
    async with service(redis_server) as client:
        status, reply = await _push(client, "actor-1", 1, c)
        assert status == 409 and reply["error"]["code"] == "batch_mismatch", reply
        status, reply = await _push(client, "actor-1", 1, b)
        assert status == 200 and not reply["appended"], reply
        status, reply = await _push(client, "actor-1", 2, c)
        assert status == 200 and reply["appended"] and reply["count"] == other, reply
    assert _stream(redis_server.url, "actor-1") == a + b + c
    await r.aclose()
