"""The push append's share of the event loop, against a real Redis.

Property: appending a batch of many slices (10,000 records: 40 slices) hands the loop
back after packing each slice, so another task runs between any two slices packed
(before, all 40 were packed in one go: 54 ms of CPU on the loop for this batch), and
the batch still lands whole, once, in order. Structure only: no time is measured.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from redis.asyncio import Redis

from ingest_service.backlog import BacklogLimits
from ingest_service.datasets import create_dataset
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
