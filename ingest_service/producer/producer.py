"""The file-source producer: one dataset's records into its partitions, exactly once.

Call order: ``Producer(redis, spec)``, then ``await producer.run()``; ``stop()`` (from
any task) makes ``run`` finish the batches it has handed to Redis and return.

How it stays exactly-once (see ``planner`` for where each record goes):

1. Sync: read each partition's last ID from Redis. That ID alone says how far the
   partition got, because IDs are ``<epoch+1>-<index>`` in planning order.
2. Produce epochs from the earliest unfinished one: re-plan the epoch from the source
   and append, per partition, only the records after its last ID. All partitions are
   written concurrently (one batch in flight per partition, so a partition's batches
   stay in order); the next epoch starts when every write of this one is acknowledged.
3. Each writer owns one connection (a ``_resp.Link``, never silently reconnected) and
   first checks on it that its partitions still end where the sync saw them. A batch is
   pipelined ``XADD``s with explicit IDs, ``NOMKSTREAM`` once the stream exists: Redis
   refuses an ID not above the stream's last one (an entry already there, from a
   retried batch) and never re-creates a stream behind the producer's back. If Redis
   lost the stream or its tail (a restart without or with partial persistence) the
   replies or the check say so; the producer syncs again and refills from what Redis
   still has, or from the last retention floor it saw when a stream it wrote is gone:
   consumers never go below their floor. (A stream it never saw starts from the
   source's beginning, however early maintenance read a floor.) (Dead letters go through one Lua call,
   ``_lua.APPEND``, which skips the entries already there.)

The progress hash (``streams.progress_key``) records finished epochs, only as a hint
to skip re-reading them; the partitions' last IDs are the truth.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import fsspec.utils
import redis as redis_package
from redis.asyncio import Redis
from redis.driver_info import DriverInfo

from ingest_service import redis_client
from ingest_service._resp import Link, bulk
from ingest_service.backlog import BacklogLimits
from ingest_service.datasets import create_dataset
from ingest_service.errors import StreamLostError
from ingest_service.metrics import IngestMetrics
from ingest_service.producer.appending import Links, append_batch, check_end
from ingest_service.producer.backpressure import Backpressure
from ingest_service.producer.batching import (
    DATA,
    BatchLimits,
    BatchQueue,
    ByteBudget,
    hand_out_epoch,
)
from ingest_service.producer.dead_letters import append_dead_letters
from ingest_service.producer.finishing import mark_done, wait_finished
from ingest_service.producer.leases import LEASE_MS, PartitionLeases
from ingest_service.producer.positions import NEVER, Positions
from ingest_service.producer.progress import ProducerProgress
from ingest_service.sources.planner import PlanChunk, PlannedDeadLetter, plan_spec_chunks
from ingest_service.sources.records import GoodRecord
from trainguard.core import streams
from trainguard.core.resilience import Backoff, RetryPolicy

__all__ = ["Producer", "ProducerProgress"]

log = logging.getLogger(__name__)

_RETRYABLE: tuple[type[Exception], ...] = (StreamLostError, *redis_client.TRANSIENT)

SYNC_POLICY = RetryPolicy(attempts=None, timeout_s=None, wait_initial_s=0.1, wait_max_s=2.0,
                          wait_jitter_s=0.05)
"""Waits between syncs after Redis failed: 0.1 s doubling to 2 s, until stopped. A
restart takes seconds; the producer resumes within about 2 s of Redis answering."""


class Producer:
    def __init__(
        self,
        redis: Redis,
        spec: streams.DatasetSpec,
        *,
        storage_options: Mapping[str, Any] | None = None,
        limits: BacklogLimits | None = None,
        metrics: IngestMetrics | None = None,
        batch_records: int = 512,
        batch_bytes: int = 1024 * 1024,
        max_inflight_bytes: int = 64 * 1024 * 1024,
        connections: int = 16,
        maintenance_interval_s: float = 1.0,
        lease_ms: int = LEASE_MS,
        owner: str | None = None,
    ) -> None:
        if not spec.replayable:
            raise ValueError(f"dataset {spec.name!r} is a push dataset: it has no source to produce")
        self.redis = redis
        self.spec = spec
        kwargs = {} if redis_client.is_cluster(redis) else redis.connection_pool.connection_kwargs
        if not {"driver_info", "lib_name", "lib_version"} & kwargs.keys():
            # Otherwise redis-py reads its package metadata for every new connection
            # (milliseconds each; a producer opens one per writer per epoch). Same value.
            kwargs["driver_info"] = DriverInfo(lib_version=redis_package.__version__)
        self.storage_options = dict(storage_options or {})
        self.limits = limits or BacklogLimits()
        self.metrics = metrics or IngestMetrics()
        self.batch_records = max(1, min(batch_records, self.limits.max_entries))
        self.batch_bytes = batch_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.connections = max(1, connections)
        self.maintenance_interval_s = maintenance_interval_s
        self.progress = ProducerProgress()
        self._stop = asyncio.Event()
        p = spec.partitions
        self._keys = [streams.partition_key(spec.name, i) for i in range(p)]
        self._key_bulk = [bulk(k.encode()) for k in self._keys]
        self._at = Positions(p)
        self._pressure = Backpressure(redis, spec, self.limits, self.metrics,
                                      self.progress.paused)
        self.leases = PartitionLeases(redis, spec.name, spec.partitions, owner=owner,
                                      lease_ms=lease_ms)
        self._halt = asyncio.Event()
        """Set by ``stop()`` and by a change of leases: the epoch under way ends, and a
        writer paused for room gives up its batch (it is planned again)."""
        self.leases.on_change = self._halt.set
        self._run_id: str | None = None
        self._labels = {"dataset": spec.name}
        # Local and in-memory sources are read on the event loop (see hand_out_epoch).
        self._inline_reads = fsspec.utils.get_protocol(spec.source) in ("file", "local", "memory")

    # ------------------------------------------------------------------ public

    def stop(self) -> None:
        """Ask ``run`` to return once the batches already sent are acknowledged."""
        self._stop.set()
        self._halt.set()

    @property
    def floors(self) -> dict[int, streams.StreamId]:
        """The retention floors last seen per partition (where a refill would start)."""
        return dict(self._at.floors)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def run(self) -> None:
        """Produce every epoch (a finite dataset), or until ``stop()`` (an endless one).
        With other producers on the dataset, this one writes the partitions it leases
        (see :mod:`ingest_service.producer.leases`) and returns once the dataset is finished."""
        await create_dataset(self.redis, self.spec)
        done = asyncio.Event()
        maintenance = asyncio.create_task(self._maintain(done), name=f"maintain-{self.spec.name}")
        leases: asyncio.Task[None] | None = None
        backoff = Backoff(SYNC_POLICY)
        try:
            while not self._stop.is_set():
                try:
                    if leases is None:
                        await self.leases.round()
                        leases = asyncio.create_task(self.leases.run(done),
                                                     name=f"leases-{self.spec.name}")
                    self.leases.changed.clear()
                    if not self._stop.is_set():
                        self._halt.clear()
                    outcome = await self._run_once()
                    if outcome == "done" or (outcome == "wait" and await self._wait_for_others()):
                        return
                    backoff.reset()
                    continue  # leases changed: plan again with the partitions held now
                except* _RETRYABLE as group:
                    log.warning("dataset %s: Redis failed (%s); syncing again",
                                self.spec.name, group.exceptions[0])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), backoff.next_wait_s())
        finally:
            # An event, not cancel(): redis-py may swallow a cancellation that lands
            # inside a command, which would leave the task running.
            done.set()
            await maintenance
            if leases is not None:
                await leases
            await self.leases.release()
            with contextlib.suppress(*_RETRYABLE):
                await self.redis.delete(streams.paused_key(self.spec.name))

    def _halted(self) -> bool:
        """Stop producing now: asked to stop, or the leases changed (plan again)."""
        return self._halt.is_set()

    async def _wait_for_others(self) -> bool:
        """This producer's partitions are done, others' are not: wait until the dataset
        is finished or stopped (True) or this producer's leases change (False)."""
        finished = await wait_finished(self.redis, self.spec, self.leases, self._stop)
        if finished:
            self.progress.finished = True
        return finished is not False

    # ------------------------------------------------------------------ sync

    async def _sync(self) -> int | None:
        """Read where every partition stands; returns the epoch to start from, or None
        when there is nothing to do (finished, or the dataset was deleted)."""
        info = await self.redis.info("server")
        run_id = str(info.get("run_id", ""))
        restarted = self._run_id is not None and run_id != self._run_id
        if not await self.redis.exists(streams.meta_key(self.spec.name)):
            if self._run_id is not None and not restarted:
                log.warning("dataset %s was deleted: stopping its producer", self.spec.name)
                self.progress.deleted = True
                return None
            await create_dataset(self.redis, self.spec)
        self._run_id = run_id

        losses = self.progress.redis_losses
        await self._at.sync(self.redis, self._keys, self._pressure, self._lost)

        progress = await self.redis.hgetall(streams.progress_key(self.spec.name))
        if progress.get(streams.PROGRESS_FINISHED) == b"1" and self.spec.finite:
            return None
        hint = progress.get(streams.PROGRESS_EPOCHS_DONE)
        mine = [self._at.last[p] for p in self.leases.owned] or [None]
        earliest = min((pos[0] - 1 if pos else 0) for pos in mine)
        if hint is None:
            return earliest
        if self.progress.redis_losses > losses:
            # A partition lost records of an epoch the progress hash calls done: on a
            # cluster that hash lives on another master, which kept it. Go back to the
            # earliest epoch a partition stands in (the others skip what they hold).
            return min(int(hint), earliest)
        return int(hint)

    def _lost(self, partition: int, what: str) -> None:
        log.warning("dataset %s partition %d: Redis lost records (%s)", self.spec.name, partition, what)
        self.progress.redis_losses += 1
        self.metrics.redis_losses.labels(**self._labels).inc()

    # ------------------------------------------------------------------ epochs

    async def _run_once(self) -> Literal["done", "wait", "replan"]:
        """Produce this producer's partitions: "done" (the dataset is finished, deleted,
        or this producer was stopped), "wait" (its partitions are done, others' not
        yet) or "replan" (its leases changed)."""
        owned = self.leases.owned
        start = await self._sync()
        if start is None:
            self.progress.finished = not self.progress.deleted
            return "done"
        if not owned:
            return "wait"
        epochs: Iterator[int] = (
            iter(range(start, self.spec.epochs or 0)) if self.spec.finite else itertools.count(start)
        )
        progress_key = streams.progress_key(self.spec.name)
        for epoch in epochs:
            self.progress.epoch = epoch
            if not await self._produce_epoch(epoch, owned):
                return "done" if self._stop.is_set() else "replan"
            if len(owned) == self.spec.partitions:  # a hint for every partition
                await self.redis.hset(progress_key, streams.PROGRESS_EPOCHS_DONE, str(epoch + 1))
        if not self.spec.finite or self._stop.is_set():
            return "done"
        if not await mark_done(self.redis, self.spec, owned, self._at.last):
            return "wait"
        self.progress.finished = True
        return "done"

    async def _produce_epoch(self, epoch: int, owned: frozenset[int]) -> bool:
        """Append what is missing of ``epoch`` in the ``owned`` partitions; False when
        halted (stopped, or the leases changed) before its end.

        ``connections`` writers (each with its own link) serve the partitions
        ``p % connections == w``: one writer per partition keeps its batches in order,
        and the number of connections stays bounded however many partitions there are.
        """
        writers = min(self.spec.partitions, self.connections)
        queues: list[BatchQueue] = [asyncio.Queue() for _ in range(writers)]
        budget = ByteBudget(self.max_inflight_bytes)
        async with asyncio.TaskGroup() as tg:
            for w in range(writers):
                tg.create_task(
                    self._writer(queues[w], epoch, budget), name=f"write-{self.spec.name}-{w}"
                )
            complete = await self._read_epoch(epoch, queues, budget, owned)
            for q in queues:
                q.put_nowait(None)
        return complete and not self._halted()

    async def _read_epoch(self, epoch: int, queues: list[BatchQueue], budget: ByteBudget,
                          owned: frozenset[int]) -> bool:
        """Plan the epoch and hand each partition's missing records to the writers."""
        chunks = self._counted(plan_spec_chunks(self.spec, epoch, self.storage_options))
        next_index = [self._at.next_index(p, epoch, owned) for p in range(self.spec.partitions)]
        if min(next_index) == NEVER:
            return True  # every partition is past this epoch
        cut = BatchLimits(self.batch_records, self.batch_bytes, self.max_inflight_bytes)
        await hand_out_epoch(chunks, next_index, queues, budget, cut, inline=self._inline_reads,
                             halted=self._halted,
                             dead_letters=lambda dead: self._dead_letters(dead, epoch))
        return not self._halted()

    def _counted(self, chunks: Iterator[PlanChunk]) -> Iterator[PlanChunk]:
        """``chunks``, and the epoch's record count into the progress once they end (a
        plan cut short by a halt says nothing)."""
        planned = 0
        for chunk in chunks:
            planned = chunk.first + len(chunk.records)
            yield chunk
        self.progress.epoch_records = planned

    # ------------------------------------------------------------------ writing

    async def _writer(self, queue: BatchQueue, epoch: int, budget: ByteBudget) -> None:
        links = Links(self.redis)
        verified: set[int] = set()
        dropped: set[int] = set()
        broken = True
        try:
            while (got := await queue.get()) is not None:
                p, first, batch, size = got
                try:
                    if p in dropped:
                        continue  # never a later batch after a dropped one: no gaps
                    link = await links.get(self._keys[p])
                    if p not in verified:
                        await self._verify(p, link)
                        verified.add(p)
                    sizes = list(map(len, map(DATA, batch)))
                    while batch:
                        n = await self._pressure.wait_room(p, sizes, self._halt)
                        if n == 0:
                            # Halted while paused (stopped, or the leases changed): drop
                            # the partition's batches from here (they are planned again)
                            # and keep draining, so that the reader never waits for us.
                            dropped.add(p)
                            break
                        await self._write(p, first, batch[:n], epoch, sum(sizes[:n]), link)
                        first, batch, sizes = first + n, batch[n:], sizes[n:]
                finally:
                    budget.give(size)
            broken = False
        finally:
            await links.close(broken=broken)

    async def _verify(self, p: int, link: Link) -> None:
        """On the writer's own connection: the partition still ends where the producer
        thinks it does (no restart of Redis since the sync)."""
        if await check_end(link, self._keys[p], self._at.last[p],
                           may_create=self._at.may_create[p]):
            self._at.may_create[p] = False

    async def _write(
        self, p: int, first: int, batch: list[GoodRecord], epoch: int, size: int, link: Link
    ) -> None:
        """One batch appended (:func:`append_batch`), then what the producer knows of
        the partition, its backlog, progress and metrics moved past it."""
        ms = epoch + 1
        skipped = await append_batch(link, self._keys[p], self._key_bulk[p], ms, first, batch,
                                     nomkstream=not self._at.may_create[p])
        added = len(batch) - skipped
        last = (ms, first + len(batch) - 1)
        self._at.last[p] = last
        self._at.may_create[p] = False
        self._pressure.backlogs[p].add((ms, first), last, len(batch), size)
        self.progress.records += added
        self.progress.skipped += skipped
        added_bytes = size * added // len(batch)
        self.progress.bytes += added_bytes
        self.metrics.records.labels(**self._labels).inc(added)
        self.metrics.bytes.labels(**self._labels).inc(added_bytes)
        self._pressure.set_lag(p)

    async def _dead_letters(self, items: list[PlannedDeadLetter], epoch: int) -> None:
        self.progress.dead_letters += await append_dead_letters(
            self.redis, self.spec.name, items, epoch, self.metrics)

    # ------------------------------------------------------------------ maintenance

    async def _maintain(self, done: asyncio.Event) -> None:
        """Every interval, and once more after ``done``: advance backlogs to new commits,
        trim, export gauges (so a finished run leaves its partitions trimmed)."""
        while True:
            final = done.is_set()  # a pass that starts after the last append
            try:
                self._at.floors.update(await self._pressure.maintain())
            except _RETRYABLE as exc:
                log.debug("dataset %s maintenance skipped: %s", self.spec.name, exc)
            if final:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), self.maintenance_interval_s)
