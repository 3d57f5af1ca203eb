"""Backpressure of one producer: per-partition backlogs, pausing a partition whose
backlog is full, and resuming it as consumers commit.

A partition's backlog is what it holds above the lowest committed offset of every
consumer group (``backlog.Backlog``); the producer asks :meth:`Backpressure.wait_room`
before each batch. A paused partition is listed in ``streams.paused_key`` (for the
admin API and the dashboard) until it has room again, the producer stops, or the
dataset disappears (then :class:`~ingest_service.errors.StreamLostError` makes the producer sync again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from redis.asyncio import Redis

from ingest_service._resp import honour_cancel
from ingest_service.backlog import (
    Backlog,
    BacklogLimits,
    apply_retention,
    min_committed,
    read_offsets,
)
from ingest_service.errors import StreamLostError
from ingest_service.metrics import IngestMetrics
from trainguard.core import streams

__all__ = ["Backpressure"]

log = logging.getLogger("ingest_service.producer.producer")


class Backpressure:
    """The backlogs of one dataset's partitions and the committed offsets that free
    them (read from Redis at most every half ``limits.poll_interval_s``)."""

    def __init__(self, redis: Redis, spec: streams.DatasetSpec, limits: BacklogLimits,
                 metrics: IngestMetrics, paused: set[int]) -> None:
        self.redis = redis
        self.spec = spec
        self.limits = limits
        self.metrics = metrics
        self.paused = paused
        """Partitions paused now (the producer's progress shows the same set)."""
        self.backlogs = [Backlog() for _ in range(spec.partitions)]
        self._committed: dict[str, dict[int, str]] = {}
        self._committed_at = -1.0
        self._lock = asyncio.Lock()
        self._labels = {"dataset": spec.name}

    async def committed(self, *, force: bool = False) -> dict[str, dict[int, str]]:
        """Every group's committed offsets (cached for half a poll interval)."""
        async with self._lock:
            now = asyncio.get_running_loop().time()
            if force or now - self._committed_at >= self.limits.poll_interval_s / 2:
                self._committed = await read_offsets(self.redis, self.spec.name, "committed")
                self._committed_at = now
            return self._committed

    async def maintain(self) -> dict[int, streams.StreamId]:
        """One maintenance pass: every backlog advanced to the groups' new commits, the
        partitions trimmed to the retention floors, the length gauges exported; returns
        the floors trimmed to (where a refill starts when Redis lost a stream)."""
        committed = await self.committed(force=True)
        for p in range(self.spec.partitions):
            self.advance(p, committed)
        floors = await apply_retention(self.redis, self.spec, self.limits)
        async with self.redis.pipeline(transaction=False) as pipe:
            for p in range(self.spec.partitions):
                pipe.xlen(streams.partition_key(self.spec.name, p))
            lengths = await pipe.execute()
        for p, n in enumerate(lengths):
            self.metrics.backlog.labels(dataset=self.spec.name, partition=str(p)).set(n)
        return floors

    def advance(self, p: int, committed: Mapping[str, Mapping[int, str]]) -> None:
        """Drop from ``p``'s backlog what every group committed."""
        self.backlogs[p].advance(min_committed(committed, p))
        self.set_lag(p)

    def set_lag(self, p: int) -> None:
        labels = {"dataset": self.spec.name, "partition": str(p)}
        self.metrics.lag.labels(**labels).set(self.backlogs[p].entries)
        self.metrics.lag_bytes.labels(**labels).set(self.backlogs[p].bytes)

    async def wait_room(self, p: int, sizes: list[int], stop: asyncio.Event) -> int:
        """How many of the next records of ``p`` (their payload ``sizes``) may be
        appended now: all that fit under the bounds, at least one (pausing the partition
        until one fits); 0 if ``stop`` is set first.

        Part of a batch, not all or nothing: a consumer commits only what it trained on,
        so it may hold a few uncommitted entries while it waits for more. Waiting for
        room for a whole batch would wait for those, and neither side would move."""
        backlog = self.backlogs[p]
        if n := backlog.room(sizes, self.limits):
            return n
        self.advance(p, await self.committed())
        if n := backlog.room(sizes, self.limits):
            return n
        await self.redis.sadd(streams.paused_key(self.spec.name), str(p))
        self.paused.add(p)
        self.metrics.pauses.labels(**self._labels).inc()
        self.metrics.paused.labels(**self._labels).set(len(self.paused))
        log.info("dataset %s partition %d paused: backlog %d entries, %d bytes",
                 self.spec.name, p, backlog.entries, backlog.bytes)
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.limits.poll_interval_s)
                honour_cancel()
                if not await self.redis.exists(streams.meta_key(self.spec.name)):
                    # Deleted (or Redis lost it) while paused: the sync tells which.
                    raise StreamLostError(f"dataset {self.spec.name!r} is gone")
                self.advance(p, await self.committed())
                if n := backlog.room(sizes, self.limits):
                    await self.redis.srem(streams.paused_key(self.spec.name), str(p))
                    return n
            return 0
        finally:
            self.paused.discard(p)
            self.metrics.paused.labels(**self._labels).set(len(self.paused))
