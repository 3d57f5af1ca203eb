"""The planner: which record goes where, as a pure function of (source, seed, epoch)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ingest_service.planner import Planned, PlannedDeadLetter, plan_chunks, plan_epoch
from ingest_service.sources import BadRecord, GoodRecord, SourceItem


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
