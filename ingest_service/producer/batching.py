"""How a producer cuts a partition's planned records into batches, and bounds the
bytes handed to its writers and not yet appended."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import operator

from ingest_service.sources.records import GoodRecord

__all__ = ["DATA", "Batch", "BatchQueue", "ByteBudget", "first_batch"]

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
