"""The producer's hand-packed XADDs and batch reply reading, against a real redis-server."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import redis
from redis._parsers import _AsyncRESP2Parser, _AsyncRESP3Parser
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ingest_service._resp import Link, _drain_each, _drain_hiredis, bulk, xadd_records
from ingest_service.producer.producer import Producer
from ingest_service.sources.records import GoodRecord
from tests._ingest_util import expected_partitions, read_partitions, write_jsonl
from tests.servers import RedisServer
from trainguard.core import streams

META = ((streams.F_KIND, streams.KIND_RAW), (b"extra", b"\x00\r\n binary"))


def _records(n: int, size: int) -> list[GoodRecord]:
    return [GoodRecord(bytes([i % 251]) * size, b"f:%d" % i, META) for i in range(n)]


async def _batch(link: Link, key: str, first: int, records: list[GoodRecord], *,
                 nomkstream: bool) -> list[Any]:
    parts: list[bytes] = []
    xadd_records(parts, bulk(key.encode()), 1, first, records, nomkstream=nomkstream)
    return await link.send_many(parts, len(records))


@pytest.mark.parametrize("protocol", [2, 3])
async def test_batch_replies_take_the_hiredis_path(redis_server: RedisServer, protocol: int) -> None:
    """With hiredis installed (a dependency), a batch's replies are read from the
    parser's hiredis reader in one loop: this fails if a redis-py upgrade moves what that
    path reaches into, instead of the producer silently falling back to the slow path.
    The replies are the XADD replies in order: IDs, an error for an ID already there,
    nil for NOMKSTREAM on a missing stream."""
    client = Redis.from_url(redis_server.url, protocol=protocol)
    link = Link(client)
    await link.open()
    try:
        assert link._drain is _drain_hiredis
        records = _records(300, 700)  # small and large values, replies over several reads
        assert await _batch(link, "s", 0, records, nomkstream=False) == [
            b"1-%d" % i for i in range(300)
        ]
        replies = await _batch(link, "s", 299, _records(2, 10), nomkstream=False)
        assert isinstance(replies[0], ResponseError) and replies[1] == b"1-300"
        assert await _batch(link, "gone", 0, _records(3, 10), nomkstream=True) == [None] * 3
    finally:
        await link.close(broken=False)
        await client.aclose()
    stored = redis.Redis.from_url(redis_server.url).xrange("s")
    assert len(stored) == 301
    assert stored[7] == (b"1-7", {**dict(META), streams.F_POS: b"f:7", streams.F_DATA: bytes([7]) * 700})


@pytest.mark.parametrize("parser", [_AsyncRESP2Parser, _AsyncRESP3Parser])
async def test_producer_without_hiredis_writes_the_same_partitions(
    redis_server: RedisServer, tmp_path: Path, parser: type
) -> None:
    """redis-py's pure-Python parsers (no hiredis) take the one-reply-at-a-time path and
    produce exactly the planned partitions."""
    write_jsonl(tmp_path, 2000, files=2)
    protocol = 3 if parser is _AsyncRESP3Parser else 2
    client = Redis.from_url(redis_server.url, parser_class=parser, protocol=protocol)
    spec = streams.DatasetSpec(name="py", partitions=4, source=str(tmp_path / "*.jsonl"),
                               format="jsonl", seed=3, epochs=1, shuffle_buffer=100)
    link = Link(client)
    await link.open()
    assert link._drain is _drain_each
    await link.close(broken=False)
    await Producer(client, spec, batch_records=64).run()
    await client.aclose()
    assert read_partitions(redis_server.url, spec) == expected_partitions(spec)


async def test_push_messages_between_replies_are_not_replies(redis_server: RedisServer) -> None:
    """On RESP3 (redis-py's default) the server may push messages between replies; here
    client-side caching invalidations, caused by another client writing keys this
    connection read. The batch still gets exactly its own replies, in order."""
    client = Redis.from_url(redis_server.url, protocol=3)
    other = redis.Redis.from_url(redis_server.url)
    link = Link(client)
    await link.open()
    try:
        assert await link.call("CLIENT", "TRACKING", "ON") == b"OK"
        for i in range(50):
            await link.call("GET", f"tracked:{i}")
        for i in range(50):
            other.set(f"tracked:{i}", "changed")  # one invalidation push each
        replies = await _batch(link, "s", 0, _records(100, 50), nomkstream=False)
        assert replies == [b"1-%d" % i for i in range(100)]
        assert await link.call("PING") == b"PONG"
    finally:
        await link.close(broken=False)
        await client.aclose()
        other.close()


async def test_a_batch_waiting_on_a_frozen_redis_times_out_and_breaks_the_link(
    redis_server: RedisServer,
) -> None:
    """Replies that never come (Redis frozen by SIGSTOP after the batch was sent) end in
    a timeout after the client's socket timeout, not a hang; the link is then broken
    (its next call raises), so the producer syncs again instead of reading late replies
    as answers to later commands."""
    client = Redis.from_url(redis_server.url, socket_timeout=0.5)
    link = Link(client)
    await link.open()
    assert redis_server.pid is not None
    os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(RedisTimeoutError):
            await asyncio.wait_for(_batch(link, "s", 0, _records(10, 100), nomkstream=False), 30)
        assert asyncio.get_running_loop().time() - started < 25  # the link's deadline, not ours
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
    with pytest.raises(RedisConnectionError):
        await link.call("PING")
    await link.close(broken=True)
    await client.aclose()


def test_small_records_encode_to_the_same_bytes_as_chunked_ones() -> None:
    """The template encoding of a batch of small records of one layout is byte for
    byte the per-record chunked one, across ID-length boundaries (9 -> 10, 99 -> 100),
    with ``%`` in the key, the fields and the positions, and with empty payloads."""
    from ingest_service._resp import _INLINE_MAX, _xadd_chunks

    meta = ((streams.F_KIND, streams.KIND_NDARRAY), (streams.F_DTYPE, b"%|u1"))
    for first in (0, 7, 95, 9990, 123456):
        for size in (0, 1, 100, _INLINE_MAX):
            records = [GoodRecord(bytes([i % 251]) * size, b"f%%:%d" % i, meta) for i in range(13)]
            for nomkstream in (False, True):
                inline: list[bytes] = []
                chunks: list[bytes] = []
                xadd_records(inline, bulk(b"k%ey"), 3, first, records, nomkstream=nomkstream)
                _xadd_chunks(chunks, bulk(b"k%ey"), 3, first, records, nomkstream=nomkstream)
                assert len(inline) < len(chunks)  # the template path was taken
                assert b"".join(inline) == b"".join(chunks)
