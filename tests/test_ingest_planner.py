"""The planner: which record goes where, as a pure function of (source, seed, epoch)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from ingest_service.sources.planner import (
    CHUNK_BYTES,
    CHUNK_RECORDS,
    DEFAULT_SHUFFLE_BUFFER_BYTES,
    PlanChunk,
    Planned,
    PlannedDeadLetter,
    _below,
    plan_chunks,
    plan_epoch,
    shuffle_rng,
)
from ingest_service.sources.records import BadRecord, GoodRecord, SourceItem


def _items(n: int, *, bad_every: int = 9, size: int = 1) -> Iterator[SourceItem]:
    """Records ``s:<i>``; every ``bad_every``-th one (from the 5th; all for 1) is a bad
    record."""
    for i in range(n):
        if bad_every and i % bad_every == 4 % bad_every:
            yield BadRecord(f"s:{i}", "schema", "test", b"")
        else:
            yield GoodRecord(b"x" * size, b"s:%d" % i, ())


def _by_partition(plan: Iterator[Planned | PlannedDeadLetter], partitions: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(partitions)]
    for item in plan:
        if isinstance(item, Planned):
            assert item.index == len(out[item.partition])
            out[item.partition].append(int(item.record.pos[2:]))
    return out


def test_planner_order_is_pinned() -> None:
    """The order of a dataset is part of its identity: a producer restarted by a newer
    trainguard (or another Python) re-plans the epoch and appends after each
    partition's last ID, so the same seed must give exactly these partitions forever.
    A change here breaks resuming every dataset in flight."""
    plans = [
        _by_partition(plan_epoch(_items(20), partitions=3, seed=7, epoch=epoch,
                                 shuffle_buffer=4), 3)
        for epoch in (0, 1)
    ]
    assert plans == [
        [[5, 1, 11, 14, 18, 17], [0, 8, 7, 9, 16, 19], [6, 10, 3, 15, 12, 2]],
        [[0, 2, 9, 15, 12, 7], [6, 5, 1, 10, 17, 19], [3, 8, 14, 11, 16, 18]],
    ]


@pytest.mark.parametrize("partitions", [1, 3, 16, 1500])
def test_chunks_split_over_partitions_as_the_per_record_plan(partitions: int) -> None:
    """Each chunk's ``by_partition`` slices give every partition the same records, at
    the same indexes, as the per-record plan (the k-th record to ``k % P`` as its
    ``k // P``-th), across chunk boundaries and for more partitions than a chunk holds."""
    kw = {"seed": 3, "epoch": 2, "shuffle_buffer": 100, "chunk_records": 37}
    sliced: list[list[int]] = [[] for _ in range(partitions)]
    for chunk in plan_chunks(_items(5000), **kw):
        for p, index, records in chunk.by_partition(partitions):
            assert records and index == len(sliced[p])
            sliced[p] += [int(r.pos[2:]) for r in records]
    per_record = _by_partition(
        plan_epoch(_items(5000), partitions=partitions, seed=3, epoch=2, shuffle_buffer=100),
        partitions,
    )
    assert sliced == per_record
    assert sorted(i for part in sliced for i in part) == [i for i in range(5000) if i % 9 != 4]


def test_dead_letters_are_numbered_in_source_order_and_chunks_stay_bounded() -> None:
    """Bad records get running numbers 0, 1, 2... in source order (their dead-letter
    IDs); a source of nothing but bad records still comes in bounded chunks."""
    chunks = list(plan_chunks(_items(3000, bad_every=1), seed=1, epoch=0, shuffle_buffer=10,
                              chunk_records=100))
    dead = [d for c in chunks for d in c.dead]
    assert [d.index for d in dead] == list(range(3000))
    assert [d.record.pos for d in dead] == [f"s:{i}" for i in range(3000)]
    assert max(len(c.dead) for c in chunks) <= 100
    assert not any(c.records for c in chunks)


def test_chunks_are_bounded_in_bytes() -> None:
    """Chunks of large records end at the byte bound, not only at the record count."""
    chunks = list(plan_chunks(_items(200, bad_every=0, size=10_000), seed=1, epoch=0,
                              shuffle_buffer=16, chunk_records=1000, chunk_bytes=50_000))
    assert sum(len(c.records) for c in chunks) == 200
    assert max(sum(r.size for r in c.records) for c in chunks) <= 50_000


def _reference_chunks(items: Iterator[SourceItem], *, seed: int, epoch: int,
                      shuffle_buffer: int, shuffle_buffer_bytes: int, chunk_records: int,
                      chunk_bytes: int) -> Iterator[PlanChunk]:
    """The planner's definition, one record at a time (what plan_chunks' docstring
    says, written as plainly as possible): the oracle for its block-wise fast path."""
    rng = shuffle_rng(seed, epoch)
    buf: list[GoodRecord] = []
    out: list[GoodRecord] = []
    dead: list[PlannedDeadLetter] = []
    bad = first = held = out_bytes = 0

    def full() -> bool:
        return len(out) >= chunk_records or out_bytes >= chunk_bytes or len(dead) >= chunk_records

    for item in items:
        if isinstance(item, BadRecord):
            dead.append(PlannedDeadLetter(bad, item))
            bad += 1
        elif shuffle_buffer <= 1:
            out.append(item)
            out_bytes += item.size
        else:
            buf.append(item)
            held += item.size
            while len(buf) > shuffle_buffer or (held > shuffle_buffer_bytes and len(buf) > 1):
                j = _below(rng.getrandbits, len(buf))
                buf[j], buf[-1] = buf[-1], buf[j]
                out.append(buf.pop())
                held -= out[-1].size
                out_bytes += out[-1].size
        if full():
            yield PlanChunk(first, out, dead)
            first += len(out)
            out, dead, out_bytes = [], [], 0
    for i in range(len(buf) - 1, 0, -1):
        j = _below(rng.getrandbits, i + 1)
        buf[i], buf[j] = buf[j], buf[i]
    for rec in buf:
        out.append(rec)
        out_bytes += rec.size
        if len(out) >= chunk_records or out_bytes >= chunk_bytes:
            yield PlanChunk(first, out, dead)
            first += len(out)
            out, dead, out_bytes = [], [], 0
    if out or dead:
        yield PlanChunk(first, out, dead)


def test_block_wise_planning_is_the_per_record_definition() -> None:
    """plan_chunks draws a block's shuffle positions in bulk and cuts chunks by search
    in the steady state; for random sources (bad records, record sizes that do and do
    not reach the byte bounds, buffers of 0 to 1024 records) its chunks, their records
    and their dead letters are exactly those of the per-record definition."""
    rng = random.Random(5)

    def items(n: int, sizes: list[int], bad_p: float) -> list[SourceItem]:
        return [BadRecord(f"s:{i}", "schema", "x", b"b" * rng.choice(sizes))
                if rng.random() < bad_p else GoodRecord(b"g" * rng.choice(sizes), b"s:%d" % i, ())
                for i in range(n)]

    def key(chunks: Iterator[PlanChunk]) -> list[Any]:
        return [(c.first, [r.pos for r in c.records], [(d.index, d.record.pos) for d in c.dead])
                for c in chunks]

    for _ in range(60):
        source = items(rng.choice([0, 1, 5, 100, 3000, 6000]),
                       rng.choice([[100], [1, 100, 1000], [0], [10000], [0, 5]]),
                       rng.choice([0.0, 0.0, 0.01, 0.5]))
        kw = {"seed": rng.randrange(9), "epoch": rng.randrange(3),
              "shuffle_buffer": rng.choice([0, 1, 2, 4, 100, 1024]),
              "shuffle_buffer_bytes": rng.choice([DEFAULT_SHUFFLE_BUFFER_BYTES, 5000, 200_000]),
              "chunk_records": rng.choice([CHUNK_RECORDS, 37, 1]),
              "chunk_bytes": rng.choice([CHUNK_BYTES, 50_000, 1])}
        assert key(plan_chunks(iter(source), **kw)) == key(_reference_chunks(iter(source), **kw)), kw
