"""How the producers of one finite dataset finish it together: each marks its own
partitions done (with where each ends, so consumers know the end), the one that finds
every partition done marks the dataset finished, and the others wait for that mark or
for a change of their leases (a take-over of a dead producer's partitions)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from ingest_service.producer.leases import PartitionLeases
from trainguard.core import streams

__all__ = ["mark_done", "wait_finished"]


async def mark_done(redis: Redis, spec: streams.DatasetSpec, owned: frozenset[int],
                    ends: Sequence[streams.StreamId | None]) -> bool:
    """Mark the ``owned`` partitions done, ending at ``ends[p]``; True when this made
    the dataset finished (every partition is done), False when others are not yet."""
    key = streams.progress_key(spec.name)
    marks: dict[Any, Any] = {streams.progress_done_field(p): b"1" for p in owned}
    marks |= {streams.progress_end_field(p): streams.format_id(end).encode()
              for p in owned if (end := ends[p]) is not None}
    await redis.hset(key, mapping=marks)
    progress = await redis.hgetall(key)
    if any(streams.progress_done_field(p) not in progress for p in range(spec.partitions)):
        return False
    await redis.hset(key, streams.PROGRESS_FINISHED, b"1")
    return True


async def wait_finished(redis: Redis, spec: streams.DatasetSpec, leases: PartitionLeases,
                        stop: asyncio.Event) -> bool | None:
    """This producer's partitions are done, others' are not: wait until the dataset is
    finished (True), this producer's leases change (False: a take-over) or ``stop`` is
    set (None)."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(leases.changed.wait(), leases.interval_s)
        if leases.changed.is_set():
            return False
        finished = await redis.hget(streams.progress_key(spec.name), streams.PROGRESS_FINISHED)
        if finished == b"1":
            return True
    return None
