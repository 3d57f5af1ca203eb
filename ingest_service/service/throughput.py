"""Throughput over time: the service samples, every ``interval_s``, how many records
each dataset's partitions were ever given (``entries-added`` of XINFO STREAM, exact
across trims) and how many each consumer group has read (``entries-read`` of XINFO
GROUPS), keeps the last ``keep`` samples in memory and exports the counts to
Prometheus, where the long history belongs.

The ring is this process's memory: a restarted service starts an empty ring (the
Prometheus series carries on). Rates are differences of consecutive samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Gauge
from redis.exceptions import RedisError

from ingest_service.inspection import as_text
from trainguard.core import streams
from trainguard.core.streams import ContractError, DatasetSpec

__all__ = ["Sample", "ThroughputSampler"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    at: float
    produced: int
    read: dict[str, int]


class ThroughputSampler:
    def __init__(self, registry: CollectorRegistry, *, interval_s: float = 1.0,
                 keep: int = 300) -> None:
        self.interval_s = interval_s
        self._rings: dict[str, deque[Sample]] = {}
        self._keep = keep
        self._produced = Gauge("trainguard_dataset_produced_entries",
                               "Records ever appended to the dataset's partitions",
                               ["dataset"], registry=registry)
        self._read = Gauge("trainguard_group_read_entries",
                           "Records the consumer group has read from the dataset",
                           ["dataset", "group"], registry=registry)

    async def sample(self, r: aioredis.Redis) -> None:
        """One sample of every registered dataset."""
        names = sorted(as_text(n) for n in await r.smembers(streams.datasets_key()))
        now = time.time()
        for name in names:
            try:
                raw = await r.hgetall(streams.meta_key(name))
                spec = DatasetSpec.from_redis(raw) if raw else None
            except (ContractError, ValueError, TypeError):
                continue
            if spec is None:
                continue
            sample = await _count(r, spec, now)
            ring = self._rings.setdefault(name, deque(maxlen=self._keep))
            ring.append(sample)
            self._produced.labels(dataset=name).set(sample.produced)
            for group, n in sample.read.items():
                self._read.labels(dataset=name, group=group).set(n)

    def series(self, dataset: str) -> list[dict[str, Any]]:
        """The ring of ``dataset`` as rates: per sample, records/s produced and read
        by each group since the previous sample."""
        ring = list(self._rings.get(dataset, ()))
        out = []
        for prev, cur in itertools.pairwise(ring):
            dt = cur.at - prev.at
            if dt <= 0:
                continue
            out.append({
                "at": cur.at, "produced": cur.produced,
                "produced_per_s": max(0, cur.produced - prev.produced) / dt,
                "read_per_s": {g: max(0, n - prev.read.get(g, 0)) / dt
                               for g, n in sorted(cur.read.items())},
            })
        return out

    async def run(self, r: aioredis.Redis, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sample(r)
            except (RedisError, OSError) as exc:
                log.debug("throughput sample failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)


_CHUNK = 8
"""Partitions a pipeline: the parse of a pipeline's replies is one event-loop step (each
XINFO STREAM reply carries the stream's first and last entry), and one over every
partition of a dataset was the service's longest: 2-5 ms at 64 partitions, 1-3 ms at
16 with records of 10-30 KiB."""


async def _count(r: aioredis.Redis, spec: DatasetSpec, now: float) -> Sample:
    produced = 0
    read: dict[str, int] = {}
    parts = list(streams.all_partitions(spec))
    for i in range(0, len(parts), _CHUNK):
        pipe = r.pipeline(transaction=False)
        for p in parts[i:i + _CHUNK]:
            pipe.xinfo_stream(streams.partition_key(spec.name, p))
            pipe.xinfo_groups(streams.partition_key(spec.name, p))
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception):
                # An expected error reply (a partition no record reached yet has no
                # stream): its traceback holds the pipeline's frames, which hold these
                # replies, a cycle only the cyclic GC frees; its gen-1 passes over those
                # every second were the loop's longest steps.
                reply.__traceback__ = None
        for info, groups in zip(replies[::2], replies[1::2]):
            if not isinstance(info, Exception) and info:
                produced += int(info.get("entries-added", info.get("length", 0)) or 0)
            for g in [] if isinstance(groups, Exception) else groups:
                n = g.get("entries-read")
                name = str(as_text(g["name"]))
                read[name] = read.get(name, 0) + (int(n) if n is not None else 0)
    return Sample(now, produced, read)
