"""The push append's share of the event loop, against a real Redis.

Property: appending a batch of many slices (10,000 records: 40 slices) hands the loop
back after packing each slice, so another task runs between any two slices packed
(before, all 40 were packed in one go: 54 ms of CPU on the loop for this batch), and
the batch still lands whole, once, in order. Structure only: no time is measured.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import sys
from typing import Any

import msgpack
import pytest
from redis.asyncio import Redis

from ingest_service.backlog import BacklogLimits
from ingest_service.datasets import create_dataset
from ingest_service.push import body as push_body
from ingest_service.push import entries as push_entries
from ingest_service.push import ingest
from ingest_service.push.ingest import PushIngest, choose_partition
from tests.servers import RedisServer
from trainguard.core import streams


async def test_a_batch_of_many_slices_hands_the_loop_back_between_slices(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between every two slices of a 10,000-record batch packed, another task of the
    loop ran; the stream then holds the 10,000 records once, in order."""
    r = Redis.from_url(redis_server.url)
    spec = streams.DatasetSpec(name="rl", partitions=2, format="push")
    await create_dataset(r, spec)
    push = PushIngest(r, BacklogLimits(), wait_replicas=0)
    records = [streams.encode_record({"n": i, "t": "x" * 40}) for i in range(10_000)]

    events: list[str] = []
    real_pack = ingest._pack_slice

    def pack(*args: Any) -> list[bytes]:  # the real packing, its calls recorded
        events.append("pack")
        return real_pack(*args)

    monkeypatch.setattr(ingest, "_pack_slice", pack)
    stop = asyncio.Event()

    async def other() -> None:
        while not stop.is_set():
            events.append("other")
            await asyncio.sleep(0)

    ticker = asyncio.ensure_future(other())
    await asyncio.sleep(0)
    result = await push.append(spec, "w-1", 0, records)
    stop.set()
    await ticker
    packs = [i for i, e in enumerate(events) if e == "pack"]
    assert len(packs) == len(ingest._slices([streams.record_size(f) for f in records])) == 40
    assert all("other" in events[a + 1:b] for a, b in itertools.pairwise(packs))
    assert result.count == 10_000
    entries = await r.xrange(streams.partition_key("rl", choose_partition("w-1", 2)))
    assert [streams.decode_record(f)["n"] for _, f in entries] == list(range(10_000))
    await r.aclose()


async def _parse_beside_a_ticker(body: bytes, content_type: str) -> tuple[list[str], Any]:
    """Parse ``body`` on the loop beside a task that logs each turn it gets ("other");
    each record encoded logs "record", and each garbage collector pass started inside
    a parse slice (``_parse`` running, on the stack) logs "gc"."""
    events: list[str] = []
    real_encode = push_entries._encode

    def encode(*args: Any) -> Any:  # the real encoding, its calls recorded
        events.append("record")
        return real_encode(*args)

    def on_gc(phase: str, info: dict[str, int]) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is push_body._parse.__code__:
                events.append("gc")
                return
            frame = frame.f_back  # type: ignore[assignment]

    stop = asyncio.Event()

    async def other() -> None:
        while not stop.is_set():
            events.append("other")
            await asyncio.sleep(0)

    ticker = asyncio.ensure_future(other())
    await asyncio.sleep(0)
    gc.callbacks.append(on_gc)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(push_entries, "_encode", encode)
            batch = await push_body.parse_records_sliced(
                bytearray(body), content_type, 16 * 2**20, push_body.BodyLimits())
    finally:
        gc.callbacks.remove(on_gc)
        stop.set()
        await ticker
    return events, batch


@pytest.mark.parametrize("content_type", ["application/msgpack", "application/json"])
async def test_records_of_many_containers_each_take_a_slice_of_their_own(
        content_type: str) -> None:
    """Property: a body of 40 accepted records of 9,999 lists each (just within the
    10,000 per record) hands the loop back between any two records decoded, and no
    garbage collector pass runs inside a parse slice: a slice's work is bounded by one
    record's containers, not by its bytes (before: 13 such msgpack records per 128 KiB
    slice, 170 ms of the loop, and collector passes over them inside the slice). The 40
    records come out whole and in order. Structure only: no time is measured."""
    records = [[[]] * 9_998 + [i] for i in range(40)]
    body = (msgpack.packb(records) if content_type == "application/msgpack"
            else json.dumps(records, separators=(",", ":")).encode())
    events, batch = await _parse_beside_a_ticker(body, content_type)
    decoded = [i for i, e in enumerate(events) if e == "record"]
    assert len(decoded) == 40
    assert all("other" in events[a + 1:b] for a, b in itertools.pairwise(decoded))
    assert "gc" not in events
    assert [streams.decode_record(f)[-1] for f in batch.records] == list(range(40))
    assert all(len(streams.decode_record(f)) == 9_999 for f in batch.records)


@pytest.mark.parametrize("content_type", ["application/msgpack", "application/json"])
async def test_a_heavy_slice_rests_so_a_request_of_several_steps_waits_behind_one(
        content_type: str) -> None:
    """Property: behind a slice of one record of 9,999 lists (within the bound, but a
    record is decoded in one call: milliseconds of CPU, over ``heavy_slice_cpu_ms``),
    the loop gets at least three turns before the next record is decoded, in a body
    under ``big_body_bytes`` too (it parsed at the full share). A request of several
    loop steps (read, handler, write: a /healthz) then waits behind one such slice, not
    one per step (before: one turn between records, and a /healthz beside this body
    waited 5-20x its p99). Every record still comes out, in order. Structure only: the
    turns are counted, no time is asserted."""
    records = [[[]] * 9_998 + [i] for i in range(20)]
    body = (msgpack.packb(records) if content_type == "application/msgpack"
            else json.dumps(records, separators=(",", ":")).encode())
    assert len(body) < push_body.BodyLimits().big_body_bytes
    events, batch = await _parse_beside_a_ticker(body, content_type)
    decoded = [i for i, e in enumerate(events) if e == "record"]
    assert len(decoded) == 20
    turns = [events[a + 1:b].count("other") for a, b in itertools.pairwise(decoded)]
    assert min(turns) >= 3, turns
    assert [streams.decode_record(f)[-1] for f in batch.records] == list(range(20))
