"""Helpers of the ingest tests: source files, expected partitions, stream reads."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis

from ingest_service.sources.planner import Planned, plan_spec_epoch
from trainer_client import redis_client as trainer_redis
from trainguard.core import streams

Entries = list[tuple[bytes, dict[bytes, bytes]]]

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "_ingest_worker.py"


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


def run_worker(url: str, spec: streams.DatasetSpec) -> subprocess.Popen[bytes]:
    """A producer of ``spec`` in its own process (``tests/_ingest_worker.py``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    spec_json = json.dumps({k: v for k, v in spec.__dict__.items()})
    return subprocess.Popen(
        [sys.executable, str(WORKER), url, spec_json, "64"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def kill_at_random_points(url: str, spec: streams.DatasetSpec, total: int, kills: int,
                          *, seed: int = 1234) -> int:
    """SIGKILL a producer process of ``spec`` once the partitions hold each of ``kills``
    random record counts (of ``total``), restarting it each time, then let one run to
    the end. Returns how many kills hit a running producer."""
    rng = random.Random(seed)
    targets = sorted(rng.sample(range(total // 50, total - total // 50), kills))
    client = trainer_redis.client(url)
    landed = 0
    try:
        for target in targets:
            proc = run_worker(url, spec)
            while proc.poll() is None and total_len(client, spec) < target:
                time.sleep(0.002)
            if proc.poll() is None:
                proc.kill()
                landed += 1
            proc.wait()
            assert proc.returncode in (0, -9), proc.stderr.read() if proc.stderr else ""
        final = run_worker(url, spec)
        _, err = final.communicate(timeout=240)
        assert final.returncode == 0, err.decode()
    finally:
        client.close()
    return landed


async def push_marks(r: Any, dataset: str, partition: int) -> dict[bytes, bytes]:
    """A partition's push marks (producer -> its last complete seq, and ``:acked``), with
    each ``<producer>:last`` field (the seq, count and digest of that producer's last
    complete batch) checked to name the producer's mark and then left out."""
    fields: dict[bytes, bytes] = await r.hgetall(streams.seq_key(dataset, partition))
    marks = {k: v for k, v in fields.items() if not k.endswith(b":last")}
    for key, last in fields.items():
        if key.endswith(b":last"):
            producer = key[: -len(b":last")]
            assert last.split(b":")[0] == marks[producer], (key, last, marks)
    return marks
