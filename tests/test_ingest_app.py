"""The aiohttp service over a real socket: health, metrics, push, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer

from ingest_service import redis_client as ingest_redis
from ingest_service.backlog import BacklogLimits
from ingest_service.datasets import create_dataset, delete_dataset
from ingest_service.push.body import BodyLimits
from ingest_service.push.ingest import choose_partition
from ingest_service.service.app import create_app
from ingest_service.service.auth import PushTokens
from ingest_service.service.config import IngestConfig
from tests._ingest_util import push_marks, until, write_jsonl
from tests.servers import RedisServer, free_port
from trainguard.core import streams

ROOT = Path(__file__).resolve().parent.parent
URL = "/v1/datasets/{}/records"
PUSH_TOKEN = "test-producer-token-0123"
PUSH_AUTH = {"Authorization": f"Bearer {PUSH_TOKEN}"}


@asynccontextmanager
async def serving(config: IngestConfig) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(create_app(config), host="127.0.0.1")) as client:
        yield client


def _config(redis_server: RedisServer, **kw: object) -> IngestConfig:
    base: dict[str, object] = dict(
        redis_url=redis_server.url, discover_interval_s=0.05, maintenance_interval_s=0.05,
        push_tokens=PushTokens.parse(f"{PUSH_TOKEN}:*:*"),
    )
    base.update(kw)
    return IngestConfig(**base)  # type: ignore[arg-type]


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name}{{{want}}} not found")


async def _push(client: TestClient, name: str, producer: str, seq: int, body: bytes,
                content_type: str = "application/x-ndjson", **params: str):  # type: ignore[no-untyped-def]
    return await client.post(
        URL.format(name), params={"producer_id": producer, "seq": str(seq), **params},
        data=body, headers={"Content-Type": content_type, **PUSH_AUTH},
    )


def _lines(*values: object) -> bytes:
    return b"".join(json.dumps(v).encode() + b"\n" for v in values)


async def test_health_ready_and_background_producer_metrics(
    any_redis: RedisServer, tmp_path: Path
) -> None:
    """/healthz and /readyz answer 200; a file dataset registered while the app runs is
    produced in the background, and /metrics counts exactly its records; deleted and
    registered again under the same name (after its producer finished), it is
    produced again, exactly."""
    write_jsonl(tmp_path, 700)
    async with serving(_config(any_redis)) as client:
        assert (await client.get("/healthz")).status == 200
        ready = await client.get("/readyz")
        assert ready.status == 200 and (await ready.json())["ready"] is True
        r = ingest_redis.client(any_redis.url)
        spec = streams.DatasetSpec(name="bg", partitions=3, source=str(tmp_path / "*.jsonl"))
        await create_dataset(r, spec)

        async def finished() -> bool:
            return await r.hget(streams.progress_key("bg"), streams.PROGRESS_FINISHED) == b"1"

        await until(finished)
        text = await (await client.get("/metrics")).text()
        assert _metric(text, "trainguard_ingest_records_total", dataset="bg") == 700
        await delete_dataset(r, "bg")
        write_jsonl(tmp_path / "again", 50)
        await create_dataset(r, dataclasses.replace(spec, source=str(tmp_path / "again" / "*.jsonl")))
        await until(finished, timeout_s=20.0)
        assert sum([await r.xlen(streams.partition_key("bg", p)) for p in range(3)]) == 50
        await r.aclose()


async def test_background_failure_of_any_kind_is_logged(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer that fails with a Redis error reply (a partition key of the wrong
    type) is logged with its dataset, not retried in silence."""
    write_jsonl(tmp_path, 10)
    r = ingest_redis.client(redis_server.url)
    await r.set(streams.partition_key("bad", 0), b"not a stream")
    async with serving(_config(redis_server)):
        await create_dataset(r, streams.DatasetSpec(
            name="bad", partitions=1, source=str(tmp_path / "*.jsonl")))

        async def logged() -> bool:
            return any("dataset bad: background work failed" in rec.getMessage()
                       and "WRONGTYPE" in (rec.exc_text or str(rec.exc_info))
                       for rec in caplog.records)

        await until(logged, timeout_s=20.0)
    await r.aclose()


async def test_readyz_is_503_without_redis(redis_server: RedisServer) -> None:
    """With Redis gone, /readyz says 503 with the reason, /healthz still 200."""
    async with serving(_config(redis_server, produce=False)) as client:
        redis_server.kill()
        ready = await client.get("/readyz")
        assert ready.status == 503 and "redis" in (await ready.json())["reason"]
        assert (await client.get("/healthz")).status == 200


async def test_push_retry_is_appended_once_and_producers_keep_their_sequences(
    any_redis: RedisServer,
) -> None:
    """The same batch sent 3 times is appended once (the retries answer appended=false);
    a seq that skips ahead is 409 with the mark; two producers pushing concurrently
    each keep their own marks; the partition holds every record once, each producer's
    in its seq order."""
    r = ingest_redis.client(any_redis.url)
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=1, format="push"))
    async with serving(_config(any_redis)) as client:
        answers = []
        for _ in range(3):
            resp = await _push(client, "rl", "a", 0, _lines({"p": "a", "n": 0}, {"p": "a", "n": 1}))
            assert resp.status == 200
            answers.append(await resp.json())
        assert [a["appended"] for a in answers] == [True, False, False]
        assert [a["count"] for a in answers] == [2, 0, 0]
        ahead = await _push(client, "rl", "a", 2, _lines({"p": "a", "n": -1}))
        assert ahead.status == 409 and (await ahead.json())["error"]["mark"] == 0

        async def producer(name: str, first: int) -> None:
            for seq in range(first, first + 20):
                body = msgpack.packb([{"p": name, "n": seq * 10}, {"p": name, "n": seq * 10 + 1}])
                for _ in range(2):  # every batch also retried once
                    resp = await _push(client, "rl", name, seq, body, "application/msgpack")
                    assert resp.status == 200, await resp.text()

        await asyncio.gather(producer("a", 1), producer("b", 0))
    entries = await r.xrange(streams.partition_key("rl", 0))
    marks = await push_marks(r, "rl", 0)
    await r.aclose()
    got = [streams.decode_record(f) for _, f in entries]
    assert len(got) == 2 + 2 * 20 * 2
    assert marks == {b"a": b"20", b"b": b"19", b":acked": b"41"}  # 41 whole batches
    for name, seqs in (("a", range(0, 21)), ("b", range(0, 20))):
        ns = [v["n"] for v in got if v["p"] == name]
        assert ns == [n for seq in seqs for n in (seq * 10, seq * 10 + 1)]


async def test_a_batch_of_several_slices_is_appended_once_after_redis_lost_its_script(
    redis_server: RedisServer,
) -> None:
    """A batch of 600 records goes in 3 Lua slices, pipelined; after SCRIPT FLUSH (a
    Redis restarted without its scripts) the first slice finds the script missing, it is
    loaded, and the batch is appended whole, once, in order, with the mark at its seq;
    the next batch goes in normally."""
    r = ingest_redis.client(redis_server.url)
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=1, format="push"))
    async with serving(_config(redis_server, produce=False)) as client:
        resp = await _push(client, "rl", "a", 0, msgpack.packb([b"warm"]), "application/msgpack")
        assert resp.status == 200
        await r.script_flush()
        batch = [b"%d" % i for i in range(600)]
        resp = await _push(client, "rl", "a", 1, msgpack.packb(batch), "application/msgpack")
        reply = await resp.json()
        assert resp.status == 200 and reply["count"] == 600 and reply["mark"] == 1, reply
        resp = await _push(client, "rl", "a", 2, msgpack.packb([b"next"]), "application/msgpack")
        assert resp.status == 200 and (await resp.json())["count"] == 1
    entries = await r.xrange(streams.partition_key("rl", 0))
    assert [streams.decode_record(f) for _, f in entries] == [b"warm", *batch, b"next"]
    assert reply["first_id"] == entries[1][0].decode() and reply["last_id"] == entries[600][0].decode()
    assert await push_marks(r, "rl", 0) == {b"a": b"2", b":acked": b"3"}
    await r.aclose()


async def test_push_follows_a_dataset_recreated_with_other_partitions(
    redis_server: RedisServer,
) -> None:
    """The service reads a dataset's spec with the producer's mark in one round trip,
    guessing the partition from the spec it saw last: after the dataset is deleted and
    created again with another partition count, a producer's batches go to (and its mark
    is read from) the partition the new spec gives, never the old one."""
    r = ingest_redis.client(redis_server.url)
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=1, format="push"))
    producer = next(f"actor-{i}" for i in range(100) if choose_partition(f"actor-{i}", 4) != 0)
    async with serving(_config(redis_server, produce=False)) as client:
        for seq in range(2):
            resp = await _push(client, "rl", producer, seq, _lines(seq))
            assert resp.status == 200 and (await resp.json())["partition"] == 0
        await delete_dataset(r, "rl")
        await create_dataset(r, streams.DatasetSpec(name="rl", partitions=4, format="push"))
        # A mark in the partition the old spec gave: read from there, seq 0 would be "in".
        await r.hset(streams.seq_key("rl", 0), producer, "5")
        stale = await _push(client, "rl", producer, 2, _lines(2))  # its mark went with the dataset
        assert stale.status == 409 and (await stale.json())["error"]["mark"] is None
        resp = await _push(client, "rl", producer, 0, _lines("new"))
        reply = await resp.json()
    p = choose_partition(producer, 4)
    assert resp.status == 200 and reply["partition"] == p, reply
    entries = await r.xrange(streams.partition_key("rl", p))
    assert [streams.decode_record(f) for _, f in entries] == ["new"]
    assert await r.xlen(streams.partition_key("rl", 0)) == 0
    assert await push_marks(r, "rl", p) == {producer.encode(): b"0", b":acked": b"1"}
    assert await r.hgetall(streams.seq_key("rl", 0)) == {producer.encode(): b"5"}
    await r.aclose()


async def test_push_rejects_malformed_and_oversized_bodies(redis_server: RedisServer) -> None:
    """400 with the reason for bad JSON, bad msgpack, a missing seq or an empty body;
    413 for a body over the limit and for a record over max_record_bytes; 404 for an
    unknown dataset; 409 for a file dataset. Nothing is appended by any of them."""
    r = ingest_redis.client(redis_server.url)
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=2, format="push",
                                                max_record_bytes=200))
    await create_dataset(r, streams.DatasetSpec(name="files", source="memory://x.jsonl"))
    config = _config(redis_server, produce=False, push_limits=BodyLimits(max_bytes=1000))
    async with serving(config) as client:
        cases = [
            (await _push(client, "rl", "a", 0, b'{"ok": 1}\n{broken\n'), 400, "line 2"),
            (await _push(client, "rl", "a", 0, b"\xc1", "application/msgpack"), 400, "msgpack"),
            (await _push(client, "rl", "a", 0, msgpack.packb({"a": 1}), "application/msgpack"),
             400, "array"),
            (await client.post(URL.format("rl"), params={"producer_id": "a"}, data=b"{}",
                               headers=PUSH_AUTH), 400, "seq"),
            (await _push(client, "rl", "a", 0, b"\n\n"), 400, "no record"),
            (await _push(client, "rl", "a", 0, b"[" + b"1," * 600 + b"1]"), 413, "limit"),
            (await _push(client, "rl", "a", 0, _lines("x" * 300)), 413, "line 1"),
            (await _push(client, "nope", "a", 0, _lines(1)), 404, "not registered"),
            (await _push(client, "files", "a", 0, _lines(1)), 409, "push"),
        ]
        for resp, status, reason in cases:
            assert resp.status == status, (status, await resp.text())
            error = (await resp.json())["error"]
            assert reason in error["message"] and error["code"], error
    for p in range(2):
        assert await r.xlen(streams.partition_key("rl", p)) == 0
    await r.aclose()


async def test_push_backlog_full_is_429_until_consumers_commit(redis_server: RedisServer) -> None:
    """At the backlog bound a new batch gets 429 with Retry-After (a retry of an appended
    batch is still acknowledged); once the consumer group commits, pushes go through."""
    r = ingest_redis.client(redis_server.url)
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=1, format="push"))
    await r.sadd(streams.groups_key("rl"), "run1")
    config = _config(redis_server, produce=False, limits=BacklogLimits(max_entries=4))
    async with serving(config) as client:
        assert (await _push(client, "rl", "a", 0, _lines(1, 2, 3, 4))).status == 200
        ids = [i.decode() for i, _ in await r.xrange(streams.partition_key("rl", 0))]
        full = await _push(client, "rl", "a", 1, _lines(5))
        assert full.status == 429 and full.headers["Retry-After"] == "1"
        assert (await full.json())["error"]["code"] == "backlog_full"
        assert "bound" in (await full.json())["error"]["message"]
        retry = await _push(client, "rl", "a", 0, _lines(1, 2, 3, 4))
        assert retry.status == 200 and (await retry.json())["appended"] is False
        await r.hset(streams.committed_key("rl", "run1"), "0", ids[1])
        assert (await _push(client, "rl", "a", 1, _lines(5, 6))).status == 200
        assert (await _push(client, "rl", "a", 2, _lines(7))).status == 429
        text = await (await client.get("/metrics")).text()
        assert _metric(text, "trainguard_ingest_push_requests_total", dataset="rl", status="429") == 2
    assert await r.xlen(streams.partition_key("rl", 0)) == 6
    await r.aclose()


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except OSError:
        return 0


def test_sigterm_stops_the_service_with_exit_0(redis_target: RedisServer) -> None:
    """``python -m trainguard serve`` serves /healthz, and exits 0 on SIGTERM."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": redis_target.url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "serve", "--port", str(port)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while _get(f"http://127.0.0.1:{port}/healthz") != 200:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_service_trims_push_datasets_below_the_floor(redis_server: RedisServer) -> None:
    """A push dataset has no producer; the service still applies retention to it: with
    a group's floor at the 3rd of 6 pushed entries, the 2 entries below it go."""
    r = ingest_redis.client(redis_server.url)
    await create_dataset(r, streams.DatasetSpec(name="rl", partitions=1, format="push"))
    async with serving(_config(redis_server)) as client:
        assert (await _push(client, "rl", "a", 0, _lines(*range(6)))).status == 200
        ids = [i.decode() for i, _ in await r.xrange(streams.partition_key("rl", 0))]
        await r.sadd(streams.groups_key("rl"), "run1")
        await r.hset(streams.floor_key("rl", "run1"), "0", ids[2])

        async def trimmed() -> bool:
            return await r.xlen(streams.partition_key("rl", 0)) == 4

        await until(trimmed)
    first = await r.xrange(streams.partition_key("rl", 0), count=1)
    assert first[0][0].decode() == ids[2]
    await r.aclose()
