"""Helpers of the ingest tests: source files, expected partitions, stream reads."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis

from ingest_service.planner import Planned, plan_spec_epoch
from trainer_client import redis_client as trainer_redis
from trainguard.core import streams

Entries = list[tuple[bytes, dict[bytes, bytes]]]


def write_jsonl(folder: Path, count: int, *, files: int = 1, bad_every: int = 0) -> int:
    """``count`` records ``{"i": n, "pad": ...}`` over ``files`` files; with
    ``bad_every``, a broken JSON line follows every that many records. Returns the
    number of broken lines."""
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-count // files)
    bad = 0
    n = 0
    for f in range(files):
        with open(folder / f"part-{f:03d}.jsonl", "w") as out:
            for _ in range(per_file):
                if n >= count:
                    break
                out.write(json.dumps({"i": n, "pad": "x" * (n % 7)}) + "\n")
                n += 1
                if bad_every and n % bad_every == 0:
                    out.write('{"i": broken\n')
                    bad += 1
    return bad


def expected_partitions(spec: streams.DatasetSpec, storage_options: Any = None) -> list[Entries]:
    """What every partition must hold after a complete run: the planner's output."""
    out: list[Entries] = [[] for _ in range(spec.partitions)]
    for epoch in range(spec.epochs or 1):
        for item in plan_spec_epoch(spec, epoch, storage_options):
            if isinstance(item, Planned):
                out[item.partition].append(
                    (streams.make_id(epoch, item.index).encode(), item.fields)
                )
    return out


def read_partitions(url: str, spec: streams.DatasetSpec) -> list[Entries]:
    client = trainer_redis.client(url)
    try:
        return [
            [(i, dict(f)) for i, f in client.xrange(streams.partition_key(spec.name, p))]
            for p in range(spec.partitions)
        ]
    finally:
        client.close()


def total_len(client: redis.Redis, spec: streams.DatasetSpec) -> int:
    pipe = client.pipeline(transaction=False)
    for p in range(spec.partitions):
        pipe.xlen(streams.partition_key(spec.name, p))
    return int(sum(pipe.execute()))


def values(entries: Entries) -> list[Any]:
    return [streams.decode_record(f) for _, f in entries]


async def until(cond: Callable[[], Awaitable[bool]], timeout_s: float = 60.0) -> None:
    """Poll ``cond`` until true; fails the test after ``timeout_s`` (a hang guard only)."""
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)
