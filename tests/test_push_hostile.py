"""The service's edge under hostile and careless input, against the real service and a
real Redis: every bad request is a 4xx with the JSON error shape, the Redis streams
hold exactly what accepted requests appended, and the event loop keeps answering
while the worst-case push is refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestClient, TestServer
from redis.asyncio import Redis

from ingest_service.datasets import create_dataset
from ingest_service.push.body import BodyLimits
from ingest_service.push.ingest import choose_partition
from ingest_service.service.app import create_app
from ingest_service.service.auth import PushTokens
from ingest_service.service.config import IngestConfig
from tests._ingest_util import push_marks
from tests.admin_helpers import AUTH as ADMIN_AUTH
from tests.admin_helpers import TOKEN as ADMIN_TOKEN
from tests.admin_helpers import make_dataset, make_group
from tests.servers import RedisServer
from trainguard.core import streams

TOKEN = "rollout-token-0123456789"
OTHER = "evaluator-token-98765432"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NDJSON = {"Content-Type": "application/x-ndjson"}
URL = "/v1/datasets/{}/records"


@asynccontextmanager
async def service(redis_server: RedisServer, **kw: Any) -> AsyncIterator[TestClient]:
    import os

    config = IngestConfig(
        redis_url=redis_server.url, produce=False,
        push_tokens=PushTokens.parse(f"{TOKEN}:rl,files,nope:actor-*;{OTHER}:evals:evaluator"),
        **kw,
    )
    os.environ["TRAINGUARD_ADMIN_TOKEN"] = ADMIN_TOKEN
    try:
        app = create_app(config)
    finally:
        del os.environ["TRAINGUARD_ADMIN_TOKEN"]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


async def _datasets(r: Redis) -> None:
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=2, format="push",
                                                max_record_bytes=4096))
    await create_dataset(r, streams.DatasetSpec(name="evals", partitions=1, format="push"))
    await create_dataset(r, streams.DatasetSpec(name="files", source="memory://x.jsonl"))


async def _is_error(resp: Any, status: int, code: str | None = None) -> dict[str, Any]:
    body = await resp.json()
    assert resp.status == status, (status, body)
    assert resp.content_type == "application/json"
    assert set(body) == {"error"} and {"code", "message"} <= set(body["error"]), body
    if code is not None:
        assert body["error"]["code"] == code, body
    return dict(body["error"])


def _lines(*values: object) -> bytes:
    return b"".join(json.dumps(v).encode() + b"\n" for v in values)


# (name, query, headers, body, status, code): one row per class of bad request.
BAD_PUSHES: list[tuple[str, dict[str, str], dict[str, str], bytes, int, str]] = [
    ("no token", {"producer_id": "actor-1", "seq": "0"}, NDJSON, b"1\n", 401, "unauthorized"),
    ("wrong token", {"producer_id": "actor-1", "seq": "0"},
     {**NDJSON, "Authorization": "Bearer not-a-token-of-this-service"}, b"1\n", 401, "unauthorized"),
    ("basic scheme", {"producer_id": "actor-1", "seq": "0"},
     {**NDJSON, "Authorization": f"Basic {TOKEN}"}, b"1\n", 401, "unauthorized"),
    ("producer of another token", {"producer_id": "evaluator", "seq": "0"}, {**NDJSON, **AUTH},
     b"1\n", 403, "forbidden"),
    ("producer out of scope", {"producer_id": "intruder", "seq": "0"}, {**NDJSON, **AUTH},
     b"1\n", 403, "forbidden"),
    ("text/plain (a browser form)", {"producer_id": "actor-1", "seq": "0"},
     {"Content-Type": "text/plain", **AUTH}, b"1\n", 415, "unsupported_media_type"),
    ("no content type", {"producer_id": "actor-1", "seq": "0"}, AUTH, b"1\n", 415,
     "unsupported_media_type"),
    ("negative seq", {"producer_id": "actor-1", "seq": "-1"}, {**NDJSON, **AUTH}, b"1\n", 400,
     "bad_request"),
    ("exponent seq", {"producer_id": "actor-1", "seq": "1e3"}, {**NDJSON, **AUTH}, b"1\n", 400,
     "bad_request"),
    ("non-ASCII digit seq", {"producer_id": "actor-1", "seq": "\u0663"}, {**NDJSON, **AUTH},
     b"1\n", 400, "bad_request"),
    ("seq of 5000 digits", {"producer_id": "actor-1", "seq": "9" * 5000}, {**NDJSON, **AUTH},
     b"1\n", 400, "bad_request"),
    ("seq past 2^53", {"producer_id": "actor-1", "seq": str(2**53)}, {**NDJSON, **AUTH}, b"1\n",
     400, "bad_request"),
    ("producer_id with a colon", {"producer_id": "actor-1:inflight", "seq": "0"},
     {**NDJSON, **AUTH}, b"1\n", 400, "bad_request"),
    ("partition chosen by the client", {"producer_id": "actor-1", "seq": "0", "partition": "1"},
     {**NDJSON, **AUTH}, b"1\n", 400, "bad_request"),
    ("broken JSON line", {"producer_id": "actor-1", "seq": "0"}, {**NDJSON, **AUTH},
     b'{"a": 1}\n{oops\n', 400, "bad_request"),
    ("integer of 5000 digits", {"producer_id": "actor-1", "seq": "0"}, {**NDJSON, **AUTH},
     b"9" * 5000 + b"\n", 400, "bad_request"),
    ("integer over 64 bits", {"producer_id": "actor-1", "seq": "0"}, {**NDJSON, **AUTH},
     str(2**64).encode() + b"\n", 400, "bad_request"),
    ("JSON nested 20,000 deep", {"producer_id": "actor-1", "seq": "0"}, {**NDJSON, **AUTH},
     b"[" * 20_000 + b"]" * 20_000 + b"\n", 413, "too_large"),
    ("not UTF-8", {"producer_id": "actor-1", "seq": "0"}, {**NDJSON, **AUTH}, b'"\xff\xfe"\n', 400,
     "bad_request"),
    ("JSON that is not an array", {"producer_id": "actor-1", "seq": "0"},
     {"Content-Type": "application/json", **AUTH}, b'{"a": 1}', 400, "bad_request"),
    ("msgpack nested deeper than its stack", {"producer_id": "actor-1", "seq": "0"},
     {"Content-Type": "application/msgpack", **AUTH}, b"\x91" * 5000 + b"\x90", 413, "too_large"),
    ("msgpack with trailing bytes", {"producer_id": "actor-1", "seq": "0"},
     {"Content-Type": "application/msgpack", **AUTH}, msgpack.packb([1]) + b"\x01", 400,
     "bad_request"),
    ("record over max_record_bytes", {"producer_id": "actor-1", "seq": "0"}, {**NDJSON, **AUTH},
     _lines("x" * 5000), 413, "too_large"),
    ("msgpack record over max_record_bytes", {"producer_id": "actor-1", "seq": "0"},
     {"Content-Type": "application/msgpack", **AUTH}, msgpack.packb([b"x", b"x" * 5000]), 413,
     "too_large"),
    ("too many NDJSON lines", {"producer_id": "actor-1", "seq": "0"}, {**NDJSON, **AUTH},
     b"1\n" * 101, 413, "too_large"),
    ("msgpack array header over the record limit", {"producer_id": "actor-1", "seq": "0"},
     {"Content-Type": "application/msgpack", **AUTH}, b"\xdd\x00\x01\x00\x00", 413, "too_large"),
    ("JSON array over the record limit", {"producer_id": "actor-1", "seq": "0"},
     {"Content-Type": "application/json", **AUTH}, json.dumps([1] * 101).encode(), 413,
     "too_large"),
    ("body over the byte limit", {"producer_id": "actor-1", "seq": "0"}, {**NDJSON, **AUTH},
     _lines("y" * 3000) * 30, 413, "too_large"),
    ("skips ahead of the mark", {"producer_id": "actor-1", "seq": "5"}, {**NDJSON, **AUTH},
     b"1\n", 409, "out_of_order"),
]


async def test_every_bad_push_is_a_4xx_json_error_and_appends_nothing(
    redis_server: RedisServer,
) -> None:
    """Each row of BAD_PUSHES gets its status and error code as JSON; a valid push
    after all of them is the only thing in the streams, and its reply is small."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    limits = BodyLimits(max_bytes=64 * 1024, max_records=100)
    async with service(redis_server, push_limits=limits) as client:
        for name, query, headers, body, status, code in BAD_PUSHES:
            resp = await client.post(URL.format("rl"), params=query, headers=headers, data=body)
            error = await _is_error(resp, status, code)
            assert error["message"], name
        # Names and dataset kinds.
        ok = {"producer_id": "actor-1", "seq": "0"}
        for dataset, status, code in (("no such", 400, "bad_request"), ("x" * 200, 400, "bad_request"),
                                      ("nope", 404, "not_found"), ("files", 409, "not_a_push_dataset")):
            resp = await client.post(URL.format(dataset), params=ok, headers={**NDJSON, **AUTH},
                                     data=b"1\n")
            await _is_error(resp, status, code)
        # A Host the service does not answer to (DNS rebinding), and a non-ASCII token.
        resp = await client.post(URL.format("rl"), params=ok, data=b"1\n",
                                 headers={**NDJSON, **AUTH, "Host": "evil.example"})
        await _is_error(resp, 421, "misdirected")
        resp = await client.post(URL.format("rl"), params=ok, data=b"1\n",
                                 headers={**NDJSON, "Authorization": "Bearer t\u00f6ken-t\u00f6ken-t\u00f6ken"})
        await _is_error(resp, 401, "unauthorized")
        good = await client.post(URL.format("rl"), params=ok, headers={**NDJSON, **AUTH},
                                 data=_lines(1, 2, 3))
        reply = await good.json()
        assert good.status == 200 and set(reply) == {
            "appended", "partition", "seq", "mark", "count", "first_id", "last_id"}
        assert reply["count"] == 3 and reply["mark"] == 0
        # Below the mark: acknowledged as in, nothing added.
        again = await client.post(URL.format("rl"), params=ok, headers={**NDJSON, **AUTH},
                                  data=_lines(1, 2, 3))
        assert (await again.json())["appended"] is False
    p = choose_partition("actor-1", 2)
    assert await r.xlen(streams.partition_key("rl", p)) == 3
    assert await r.xlen(streams.partition_key("rl", 1 - p)) == 0
    assert await push_marks(r, "rl", p) == {b"actor-1": b"0", b":acked": b"1"}
    await r.aclose()


async def test_no_token_configured_refuses_pushes(redis_server: RedisServer) -> None:
    """Without any producer token, a push is 403 push_disabled with what to set, and
    appends nothing; --insecure-local (the demo's switch) accepts it."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    ok = {"producer_id": "actor-1", "seq": "0"}
    config = IngestConfig(redis_url=redis_server.url, produce=False)
    async with TestClient(TestServer(create_app(config), host="127.0.0.1")) as client:
        resp = await client.post(URL.format("rl"), params=ok, headers=NDJSON, data=b"1\n")
        error = await _is_error(resp, 403, "push_disabled")
        assert "TRAINGUARD_PUSH_TOKENS" in error["message"]
    insecure = IngestConfig(redis_url=redis_server.url, produce=False, insecure_local=True)
    async with TestClient(TestServer(create_app(insecure), host="127.0.0.1")) as client:
        resp = await client.post(URL.format("rl"), params=ok, headers=NDJSON, data=b"1\n")
        assert resp.status == 200
    assert sum([await r.xlen(streams.partition_key("rl", p)) for p in range(2)]) == 1
    await r.aclose()


async def test_healthz_answers_while_the_worst_case_push_is_refused(
    redis_server: RedisServer,
) -> None:
    """The worst case that passes every streaming limit: a body at the byte limit of
    ten thousand records that all parse, the last one over max_record_bytes. While it
    is read and parsed, /healthz answers (before the push does), and the push is a 413
    that appends nothing."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    record = list(range(0, 900))  # about 3.4 KB of JSON, ~1.8 KB of msgpack
    body = _lines(*[record] * 4_000) + _lines("z" * 5000)
    limits = BodyLimits(max_bytes=len(body) + 1, max_records=10_000)
    async with service(redis_server, push_limits=limits) as client:
        order: list[str] = []

        async def push() -> None:
            resp = await client.post(URL.format("rl"), params={"producer_id": "actor-1", "seq": "0"},
                                     headers={**NDJSON, **AUTH}, data=body)
            await _is_error(resp, 413, "too_large")
            order.append("push")

        async def probe() -> None:
            # A separate connection, as a health checker has.
            async with ClientSession() as session:
                while "push" not in order:
                    async with session.get(client.make_url("/healthz")) as resp:
                        assert resp.status == 200
                    order.append("healthz")
                    await asyncio.sleep(0)

        await asyncio.gather(push(), probe())
        assert order.index("healthz") < order.index("push")
        assert order.count("healthz") >= 2
    assert sum([await r.xlen(streams.partition_key("rl", p)) for p in range(2)]) == 0
    await r.aclose()


async def _start_push(port: int, length: int, start: bytes
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A push of actor-1 seq 0 over a raw socket announcing ``length`` body bytes, of
    which only ``start`` is sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/datasets/rl/records?producer_id=actor-1&seq=0 HTTP/1.1\r\n"
        b"Host: 127.0.0.1\r\nContent-Type: application/x-ndjson\r\n"
        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {length}\r\n\r\n".encode()
        + start
    )
    await writer.drain()
    return reader, writer


async def test_a_trickled_body_times_out_with_408(redis_server: RedisServer) -> None:
    """A body that stops arriving is answered 408 once a chunk is overdue, and the
    service goes on answering others."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    limits = BodyLimits(chunk_timeout_s=0.3, total_timeout_s=5.0)
    async with service(redis_server, push_limits=limits) as client:
        reader, writer = await _start_push(client.port, 1000, b"1\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        writer.close()
        assert (await client.get("/healthz")).status == 200
    assert sum([await r.xlen(streams.partition_key("rl", p)) for p in range(2)]) == 0
    await r.aclose()


async def test_bodies_past_the_memory_bound_are_503_busy(redis_server: RedisServer) -> None:
    """With room for 1,000 bytes of bodies in memory, a push that declared 606 bytes
    (its share taken before its body is read; 600 of them arrived, the body
    unfinished) leaves no room for a second one: that is 503 busy with Retry-After
    and appends nothing; once the first is finished, the second goes in."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    limits = BodyLimits(max_bytes=1000, max_inflight_bytes=1000)
    first = _lines(*["a" * 100] * 5) + b'"' + b"f" * 84  # 600 bytes: 5 lines and a part
    rest = b'ffff"\n'  # ends the 6th line
    async with service(redis_server, push_limits=limits) as client:
        reader, writer = await _start_push(client.port, len(first + rest), first)
        held = f"trainguard_ingest_push_body_bytes {float(len(first + rest))}"
        for _ in range(1000):  # until the service holds the first body's declared share
            metrics = await (await client.get("/metrics")).text()
            if held in metrics:
                break
            await asyncio.sleep(0.01)
        assert held in metrics
        second = _lines("x" * 280, "y" * 280)
        busy = await client.post(URL.format("rl"), params={"producer_id": "actor-2", "seq": "0"},
                                 headers={**NDJSON, **AUTH}, data=second)
        await _is_error(busy, 503, "busy")
        assert busy.headers["Retry-After"] == "1"
        writer.write(rest)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        writer.close()
        again = await client.post(URL.format("rl"), params={"producer_id": "actor-2", "seq": "0"},
                                  headers={**NDJSON, **AUTH}, data=second)
        assert again.status == 200
    assert sum([await r.xlen(streams.partition_key("rl", p)) for p in range(2)]) == 6 + 2
    await r.aclose()


async def test_trickled_headers_are_cut_off(redis_server: RedisServer) -> None:
    """A connection that sends its request line and then trickles headers never gets a
    request handled: the server closes it (header_timeout_s, here 0.3 s, as
    ``trainguard serve`` configures it) while /healthz answers others."""
    config = IngestConfig(redis_url=redis_server.url, produce=False, header_timeout_s=0.3)
    server = TestServer(create_app(config), host="127.0.0.1")
    await server.start_server(keepalive_timeout=config.header_timeout_s)
    async with TestClient(server) as client:
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed = False
        for _ in range(400):  # a bound, not a clock: the server closes long before
            try:
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
                data = await asyncio.wait_for(reader.read(100), 0.05)
            except TimeoutError:
                assert (await client.get("/healthz")).status == 200
                continue
            except ConnectionError:
                closed = True
                break
            assert data == b"", data  # closed without an answer
            closed = True
            break
        assert closed
        writer.transport.abort()


async def test_pushes_to_made_up_datasets_add_no_metric_labels(redis_server: RedisServer) -> None:
    """404 pushes to 50 names that do not exist leave /metrics without any of them."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    async with service(redis_server) as client:
        for i in range(50):
            resp = await client.post(URL.format(f"made-up-{i}"),
                                     params={"producer_id": "actor-1", "seq": "0"},
                                     headers={**NDJSON, **AUTH}, data=b"1\n")
            assert resp.status in (403, 404)
        text = await (await client.get("/metrics")).text()
    assert "made-up" not in text
    await r.aclose()


async def test_push_while_redis_is_down_is_503_with_retry_after(redis_server: RedisServer) -> None:
    """Redis gone: a push is 503 JSON with Retry-After, an admin read too."""
    r = Redis.from_url(redis_server.url)
    await _datasets(r)
    await r.aclose()
    async with service(redis_server) as client:
        redis_server.kill()
        resp = await client.post(URL.format("rl"), params={"producer_id": "actor-1", "seq": "0"},
                                 headers={**NDJSON, **AUTH}, data=b"1\n")
        await _is_error(resp, 503)
        assert resp.headers["Retry-After"] == "1"
        resp = await client.get("/admin/datasets/rl")
        await _is_error(resp, 503)
        assert resp.headers["Retry-After"] == "1"


@pytest.mark.parametrize("ids, code", [
    ({"0": "1-1", "1": f"{2**64}-0"}, "bad_id"),      # the second out of range
    ({"0": "1-1", "1": "1-\u0663"}, "bad_id"),        # non-ASCII digit
    ({"0": "1-1", "1": "1-99"}, "past_end"),          # past the stream's last ID
    ({"0": "1-1", "7": "1-1"}, "bad_partition"),
])
async def test_a_refused_seek_moves_nothing(redis_server: RedisServer, ids: dict[str, str],
                                            code: str) -> None:
    """A seek with one bad target among good ones is refused with a 4xx, and no
    partition moved (the first, valid, target included)."""
    r = Redis.from_url(redis_server.url)
    await make_dataset(r, partitions=2, per_partition=5)
    await make_group(r, "toy", "run1", 2)
    async with service(redis_server) as client:
        resp = await client.post("/admin/datasets/toy/groups/run1/seek",
                                 json={"ids": ids, "force": True}, headers=ADMIN_AUTH)
        assert 400 <= resp.status < 500
        await _is_error(resp, resp.status, code)
    for p in range(2):
        groups = await r.xinfo_groups(streams.partition_key("toy", p))
        assert groups[0]["last-delivered-id"] == b"0-0"
    await r.aclose()


async def test_admin_bad_input_is_4xx_json(redis_server: RedisServer) -> None:
    """Steps with non-ASCII digits, JSON nested 100,000 deep, a wrong method (405 with
    Allow) and an unknown route are 4xx JSON errors."""
    r = Redis.from_url(redis_server.url)
    await make_dataset(r, partitions=1)
    await make_group(r, "toy", "run1", 1)
    async with service(redis_server) as client:
        resp = await client.get("/admin/checkpoints/main/\u0663")
        assert 400 <= resp.status < 500
        resp = await client.post("/admin/datasets/toy/groups/run1/seek", headers=ADMIN_AUTH,
                                 data=b"[" * 100_000 + b"]" * 100_000)
        await _is_error(resp, 400, "bad_json")
        resp = await client.put("/healthz")
        await _is_error(resp, 405)
        assert "GET" in resp.headers["Allow"]
        await _is_error(await client.get("/no/such/route"), 404)
    await r.aclose()


async def test_first_pushes_after_a_restart_load_the_backlog_once(redis_server: RedisServer) -> None:
    """A service started over a partition holding 2,500 entries, hit by 16 concurrent
    first pushes (16 producers of that partition): the backlog is read from the stream
    once (Redis counts 4 XRANGE calls: 3 pages and the empty end), not 16 times, and
    all 16 batches are appended."""
    r = Redis.from_url(redis_server.url)
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=1, format="push"))
    key = streams.partition_key("rl", 0)
    async with r.pipeline(transaction=False) as pipe:
        for i in range(2_500):
            pipe.xadd(key, streams.encode_record(i))
        await pipe.execute()
    await r.config_resetstat()
    async with service(redis_server) as client:
        replies = await asyncio.gather(*(
            client.post(URL.format("rl"), params={"producer_id": f"actor-{n}", "seq": "0"},
                        headers={**NDJSON, **AUTH}, data=b"1\n")
            for n in range(16)))
        assert [resp.status for resp in replies] == [200] * 16
    stats = await r.info("commandstats")
    assert stats["cmdstat_xrange"]["calls"] == 4
    assert await r.xlen(key) == 2_516
    await r.aclose()


async def test_reads_show_names_and_figures_and_paths_only_to_the_admin(
    redis_server: RedisServer,
) -> None:
    """Without the admin token a dataset's source is hidden; with it, it is shown with
    the password of its URL redacted."""
    r = Redis.from_url(redis_server.url)
    await create_dataset(r, streams.DatasetSpec(
        name="files", source="s3://user:hunter2@bucket/data/*.jsonl?token=abc"))
    async with service(redis_server) as client:
        anonymous = await (await client.get("/admin/datasets/files")).json()
        admin = await (await client.get("/admin/datasets/files", headers=ADMIN_AUTH)).json()
        listed = await (await client.get("/admin/datasets")).json()
    assert anonymous["spec"]["source"] is None and anonymous["name"] == "files"
    assert listed["datasets"][0]["spec"]["source"] is None
    assert admin["spec"]["source"] == "s3://user:***@bucket/data/*.jsonl?token=***"
    await r.aclose()
