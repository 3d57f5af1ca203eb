"""How a producer cuts a partition's planned records into batches, hands an epoch's
batches to its writers, and bounds the bytes handed to them and not yet appended."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import operator
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from ingest_service.sources.planner import PlanChunk, PlannedDeadLetter
from ingest_service.sources.records import GoodRecord

__all__ = ["DATA", "Batch", "BatchLimits", "BatchQueue", "ByteBudget", "first_batch",
           "hand_out_epoch"]

DATA = operator.attrgetter("data")


def first_batch(records: list[GoodRecord], max_records: int, max_bytes: int) -> tuple[int, int]:
    """(count, payload bytes) of the first batch of ``records``: it ends at the record
    that reaches ``max_records`` or ``max_bytes`` (at least one record)."""
    sizes = list(itertools.accumulate(map(len, map(DATA, records[:max_records]))))
    count = min(len(sizes), bisect.bisect_left(sizes, max_bytes) + 1)
    return count, sizes[count - 1]


Batch = tuple[int, int, list[GoodRecord], int]
"""(partition, index of the first record, records, payload bytes)."""
BatchQueue = asyncio.Queue[Batch | None]


class ByteBudget:
    """Bytes of batches handed to writers and not yet appended, bounded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._freed = asyncio.Event()

    async def take(self, n: int) -> None:
        # An empty budget admits any batch, so one batch over the limit still passes.
        while self.used and self.used + n > self.limit:
            self._freed.clear()
            await self._freed.wait()
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n
        self._freed.set()


@dataclass(frozen=True)
class BatchLimits:
    records: int
    """A batch ends at this many records..."""
    bytes: int
    """...or at the record that reaches this many payload bytes."""
    inflight_bytes: int
    """Pending records are handed over early when they pass half of this."""


async def hand_out_epoch(chunks: Iterator[PlanChunk], next_index: list[int],
                         queues: list[BatchQueue], budget: ByteBudget, limits: BatchLimits, *,
                         inline: bool, halted: Callable[[], bool],
                         dead_letters: Callable[[list[PlannedDeadLetter]], Awaitable[None]]
                         ) -> None:
    """Cut an epoch's planned chunks into batches and hand partition ``p``'s to
    ``queues[p % len(queues)]``, from ``next_index[p]`` on (what the partition holds is
    skipped), until the plan ends or ``halted()``. Memory: the shuffle buffer, one
    chunk, and at most ``limits.inflight_bytes`` of batches not yet appended.
    ``inline``: read the chunks on the loop (local sources; a thread would only compete
    for the GIL), else in a thread (a slow network read must not stall the writers)."""
    partitions = len(next_index)
    pending: list[list[GoodRecord]] = [[] for _ in range(partitions)]
    pending_first = [0] * partitions
    pending_bytes = [0] * partitions
    pending_total = 0

    async def hand_over(p: int, count: int, size: int) -> None:
        nonlocal pending_total
        batch = pending[p][:count]
        del pending[p][:count]
        await budget.take(size)
        queues[p % len(queues)].put_nowait((p, pending_first[p], batch, size))
        pending_first[p] += count
        pending_bytes[p] -= size
        pending_total -= size

    while not halted():
        chunk: PlanChunk | None
        if inline:
            chunk = next(chunks, None)
            await asyncio.sleep(0)  # let the writers run between chunks
        else:
            chunk = await asyncio.to_thread(next, chunks, None)
        if chunk is None:
            break
        for p, index, records in chunk.by_partition(partitions):
            skip = next_index[p] - index
            if skip > 0:  # already in the partition (a resumed run)
                records = records[skip:]
                index += skip
                if not records:
                    continue
            if not pending[p]:
                pending_first[p] = index
            pending[p] += records
            size = sum(map(len, map(DATA, records)))
            pending_bytes[p] += size
            pending_total += size
            while len(pending[p]) >= limits.records or pending_bytes[p] >= limits.bytes:
                await hand_over(p, *first_batch(pending[p], limits.records, limits.bytes))
        if pending_total > limits.inflight_bytes // 2:
            for p in range(partitions):  # many partitions: do not hoard
                if pending[p]:
                    await hand_over(p, len(pending[p]), pending_bytes[p])
        if chunk.dead:
            await dead_letters(chunk.dead)
    for p in range(partitions):
        if pending[p]:
            await hand_over(p, len(pending[p]), pending_bytes[p])
