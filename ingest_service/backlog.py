"""Backpressure and retention: what consumers committed, what may be trimmed.

Consumers (one group per training run, listed in ``groups_key``) publish per partition
the last ID they committed (``committed_key``) and the retention floor, the offsets of
the oldest checkpoint they keep (``floor_key``).

- Backlog of a partition: the entries after the smallest committed ID over all groups
  (no group, or a group that committed nothing there: after ``0-0``). The producer
  pauses a partition whose backlog would pass the entry or byte bound.
- Retention: a partition is trimmed (``XTRIM MINID floor``: entries below the floor go,
  the floor entry stays) only to the smallest floor over all groups, and only when every
  group published one for it. With no group nothing is trimmed, unless ``max_len`` is
  set (then ``XTRIM MAXLEN max_len``).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from redis.asyncio import Redis

from trainguard.core import streams

__all__ = [
    "BacklogLimits",
    "Backlog",
    "OffsetKind",
    "group_names",
    "read_offsets",
    "min_committed",
    "min_floor",
    "apply_retention",
]


@dataclass(frozen=True)
class BacklogLimits:
    max_entries: int = 1_000_000
    max_bytes: int = 256 * 1024 * 1024
    """Per partition, entries and bytes after the committed offsets."""
    max_len: int | None = None
    """Without consumer groups: keep at most this many entries per partition."""
    poll_interval_s: float = 0.1
    """How often a paused partition looks for new commits."""

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1:
            raise ValueError(
                f"backlog bounds must be >= 1, got max_entries={self.max_entries} "
                f"max_bytes={self.max_bytes}"
            )


class Backlog:
    """One partition's entries after the committed offset, as runs of appended entries.

    Kept as ``(first_id, last_id, count, bytes, ids)`` runs (one per appended batch), so
    its memory is a few tuples per batch, not per record. A run partly committed keeps
    its uncommitted share: the count exactly when the run's IDs are known (``ids``, given
    for push batches with automatic IDs) or consecutive in one epoch, the bytes pro rata.
    """

    def __init__(self) -> None:
        self._runs: deque[
            tuple[streams.StreamId, streams.StreamId, int, int, list[streams.StreamId] | None]
        ] = deque()
        self.entries = 0
        self.bytes = 0

    def add(
        self, first: streams.StreamId, last: streams.StreamId, count: int, size: int,
        ids: list[streams.StreamId] | None = None,
    ) -> None:
        if count <= 0:
            return
        self._runs.append((first, last, count, size, ids))
        self.entries += count
        self.bytes += size

    def clear(self) -> None:
        self._runs.clear()
        self.entries = self.bytes = 0

    def advance(self, committed: streams.StreamId) -> None:
        """Forget what is at or below ``committed``."""
        while self._runs:
            first, last, count, size, ids = self._runs[0]
            if last <= committed:
                self._runs.popleft()
                self.entries -= count
                self.bytes -= size
                continue
            if first <= committed:
                if ids is not None:
                    done = bisect.bisect_right(ids, committed)
                    rest: list[streams.StreamId] | None = ids[done:]
                    new_first = ids[done]
                elif first[0] == last[0] == committed[0]:
                    done = committed[1] - first[1] + 1
                    rest, new_first = None, (committed[0], committed[1] + 1)
                else:
                    break  # not knowable: keep the whole run until it is committed
                left = count - done
                left_bytes = size * left // count
                self._runs[0] = (new_first, last, left, left_bytes, rest)
                self.entries -= done
                self.bytes -= size - left_bytes
            break

    def has_room(self, count: int, size: int, limits: BacklogLimits) -> bool:
        if self.entries == 0:
            return True  # a single batch over the bound must still get through
        return self.entries + count <= limits.max_entries and self.bytes + size <= limits.max_bytes

    def room(self, sizes: list[int], limits: BacklogLimits) -> int:
        """How many of the next records (their payload ``sizes``) fit under the bounds
        now; at least one when the backlog is empty (a record over the bound must still
        get through)."""
        fit = min(len(sizes), limits.max_entries - self.entries)
        left = limits.max_bytes - self.bytes
        if fit > 0 and sum(sizes[:fit]) > left:
            fit = bisect.bisect_right(list(itertools.accumulate(sizes[:fit])), left)
        return max(fit, 1 if self.entries == 0 and sizes else 0)

    async def load(self, redis: Redis, key: str, after: streams.StreamId) -> None:
        """Rebuild from the stream: every entry after ``after`` (a restart forgot them)."""
        self.clear()
        start = "(" + streams.format_id(after)
        while True:
            page = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                await redis.xrange(key, min=start, max="+", count=1000),
            )
            if not page:
                return
            # Payload bytes, as the producer counts them.
            size = sum(len(fields.get(streams.F_DATA, b"")) for _, fields in page)
            first, last = streams.parse_id(page[0][0]), streams.parse_id(page[-1][0])
            self.add(first, last, len(page), size)
            start = "(" + streams.format_id(last)


async def group_names(redis: Redis, dataset: str) -> list[str]:
    raw = await redis.smembers(streams.groups_key(dataset))
    return sorted(g.decode() if isinstance(g, bytes) else str(g) for g in raw)


OffsetKind = Literal["committed", "floor"]
"""Which per-group offsets :func:`read_offsets` reads: the committed ones or the
retention floors the trainers publish."""


async def read_offsets(redis: Redis, dataset: str, kind: OffsetKind) -> dict[str, dict[int, str]]:
    """``{group: {partition: id}}`` of every registered group; kind is committed or floor."""
    key_of = {"committed": streams.committed_key, "floor": streams.floor_key}[kind]
    groups = await group_names(redis, dataset)
    out: dict[str, dict[int, str]] = {}
    for group in groups:
        out[group] = streams.offsets_from_wire(await redis.hgetall(key_of(dataset, group)))
    return out


def min_committed(per_group: Mapping[str, Mapping[int, str]], partition: int) -> streams.StreamId:
    """Smallest committed ID of ``partition`` over all groups (``0-0`` if any lacks one)."""
    if not per_group:
        return (0, 0)
    ids = [offsets.get(partition) for offsets in per_group.values()]
    if any(i is None for i in ids):
        return (0, 0)
    return min(streams.parse_id(i) for i in ids if i is not None)


def min_floor(per_group: Mapping[str, Mapping[int, str]], partition: int) -> streams.StreamId | None:
    """Smallest floor of ``partition`` over all groups; None (trim nothing) when there is
    no group or any group has not published a floor for it."""
    if not per_group:
        return None
    ids = [offsets.get(partition) for offsets in per_group.values()]
    if any(i is None for i in ids):
        return None
    return min(streams.parse_id(i) for i in ids if i is not None)


async def apply_retention(
    redis: Redis, spec: streams.DatasetSpec, limits: BacklogLimits
) -> dict[int, streams.StreamId]:
    """Trim every partition as far as retention allows; returns the floors it used."""
    floors = await read_offsets(redis, spec.name, "floor")
    used: dict[int, streams.StreamId] = {}
    async with redis.pipeline(transaction=False) as pipe:
        for p in range(spec.partitions):
            key = streams.partition_key(spec.name, p)
            if floors:
                floor = min_floor(floors, p)
                if floor is not None and floor > (0, 0):
                    used[p] = floor
                    pipe.xtrim(key, minid=streams.format_id(floor), approximate=False)
            elif limits.max_len is not None:
                pipe.xtrim(key, maxlen=limits.max_len, approximate=False)
        if len(pipe):
            await pipe.execute()
    return used
