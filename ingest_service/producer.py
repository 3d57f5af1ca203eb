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
   still has, or from the last retention floor it saw when the stream is gone:
   consumers never go below their floor. (Dead letters go through one Lua call,
   ``_lua.APPEND``, which skips the entries already there.)

The progress hash (``streams.progress_key``) records finished epochs, only as a hint
to skip re-reading them; the partitions' last IDs are the truth.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import itertools
import logging
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import fsspec.utils
import redis as redis_package
import redis.exceptions as redis_errors
from redis.asyncio import Redis
from redis.driver_info import DriverInfo

from ingest_service import _lua
from ingest_service._resp import Link, bulk, call_packed_script, honour_cancel, xadd_records
from ingest_service.backlog import (
    Backlog,
    BacklogLimits,
    apply_retention,
    min_committed,
    read_offsets,
)
from ingest_service.datasets import create_dataset
from ingest_service.metrics import IngestMetrics
from ingest_service.planner import PlanChunk, PlannedDeadLetter, plan_spec_chunks
from ingest_service.sources import GoodRecord
from trainguard import streams

__all__ = ["Producer", "ProducerProgress"]

log = logging.getLogger(__name__)

_NEVER = 1 << 62


class _StreamLost(Exception):
    """Redis no longer holds what the producer wrote to a partition: sync again."""


_RETRYABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError, _StreamLost)


@dataclass
class ProducerProgress:
    """What a running producer has done (this process only), for progress displays."""

    epoch: int = 0
    records: int = 0
    bytes: int = 0
    dead_letters: int = 0
    skipped: int = 0
    """Entries a retried batch found already there."""
    redis_losses: int = 0
    paused: set[int] = field(default_factory=set)
    finished: bool = False
    deleted: bool = False


_DATA = operator.attrgetter("data")


def _first_batch(records: list[GoodRecord], max_records: int, max_bytes: int) -> tuple[int, int]:
    """(count, payload bytes) of the first batch of ``records``: it ends at the record
    that reaches ``max_records`` or ``max_bytes`` (at least one record)."""
    sizes = list(itertools.accumulate(map(len, map(_DATA, records[:max_records]))))
    count = min(len(sizes), bisect.bisect_left(sizes, max_bytes) + 1)
    return count, sizes[count - 1]


_Batch = tuple[int, int, list[GoodRecord], int]
"""(partition, index of the first record, records, payload bytes)."""
_Queue = asyncio.Queue[_Batch | None]


class _ByteBudget:
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
    ) -> None:
        if not spec.replayable:
            raise ValueError(f"dataset {spec.name!r} is a push dataset: it has no source to produce")
        self.redis = redis
        self.spec = spec
        kwargs = redis.connection_pool.connection_kwargs
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
        self._append_sha = hashlib.sha1(_lua.APPEND.encode()).hexdigest().encode()
        self._last_id = redis.register_script(_lua.LAST_ID)
        p = spec.partitions
        self._keys = [streams.partition_key(spec.name, i) for i in range(p)]
        self._key_bulk = [bulk(k.encode()) for k in self._keys]
        self._position: list[streams.StreamId | None] = [None] * p
        """Last ID known to be in each partition (None: nothing)."""
        self._may_create: list[bool] = [True] * p
        self._floors: dict[int, streams.StreamId] = {}
        """Last retention floors seen: where to refill from when Redis lost a stream."""
        self._backlogs = [Backlog() for _ in range(p)]
        self._committed: dict[str, dict[int, str]] = {}
        self._committed_at = -1.0
        self._committed_lock = asyncio.Lock()
        self._run_id: str | None = None
        self._labels = {"dataset": spec.name}
        # Local and in-memory sources are read on the event loop, in chunks: a reader
        # thread would only compete with the loop for the GIL (a hand-off after every
        # socket call). Remote sources are read in a thread, so that a slow network
        # read does not stall the writers.
        self._inline_reads = fsspec.utils.get_protocol(spec.source) in ("file", "local", "memory")

    # ------------------------------------------------------------------ public

    def stop(self) -> None:
        """Ask ``run`` to return once the batches already sent are acknowledged."""
        self._stop.set()

    @property
    def floors(self) -> dict[int, streams.StreamId]:
        """The retention floors last seen per partition (where a refill would start)."""
        return dict(self._floors)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def run(self) -> None:
        """Produce every epoch (a finite dataset), or until ``stop()`` (an endless one)."""
        await create_dataset(self.redis, self.spec)
        done = asyncio.Event()
        maintenance = asyncio.create_task(self._maintain(done), name=f"maintain-{self.spec.name}")
        attempt = 0
        try:
            while not self._stop.is_set():
                try:
                    await self._run_once()
                    return
                except* _RETRYABLE as group:
                    log.warning("dataset %s: Redis failed (%s); syncing again",
                                self.spec.name, group.exceptions[0])
                # Only a retryable failure gets here: success returned above.
                attempt += 1
                delay = min(0.05 * 2 ** min(attempt, 6), 2.0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
        finally:
            # An event, not cancel(): redis-py may swallow a cancellation that lands
            # inside a command, which would leave the task running.
            done.set()
            await maintenance
            await self._clear_paused()

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

        async with self.redis.pipeline(transaction=False) as pipe:
            for key in self._keys:
                await self._last_id(keys=[key], client=pipe)
            lasts = await pipe.execute()
        committed = await self._refresh_committed(force=True)
        for p, raw in enumerate(lasts):
            known = self._position[p]
            if raw is None:
                floor = self._floors.get(p)
                if known is not None and (floor is None or known > floor):
                    self._lost(p, f"stream gone; refilling after {floor or 'the start'}")
                self._position[p] = floor
                self._may_create[p] = True
                self._backlogs[p].clear()
                continue
            last = streams.parse_id(raw)
            if known is not None and last < known:
                self._lost(p, f"stream ends at {streams.format_id(last)}, "
                              f"{streams.format_id(known)} was written; refilling")
            self._position[p] = last
            self._may_create[p] = False
            await self._backlogs[p].load(self.redis, self._keys[p], min_committed(committed, p))

        progress = await self.redis.hgetall(streams.progress_key(self.spec.name))
        if progress.get(streams.PROGRESS_FINISHED) == b"1" and self.spec.finite:
            return None
        hint = progress.get(streams.PROGRESS_EPOCHS_DONE)
        if hint is not None:
            return int(hint)
        return min((pos[0] - 1 if pos else 0) for pos in self._position)

    def _lost(self, partition: int, what: str) -> None:
        log.warning("dataset %s partition %d: Redis lost records (%s)", self.spec.name, partition, what)
        self.progress.redis_losses += 1
        self.metrics.redis_losses.labels(**self._labels).inc()

    # ------------------------------------------------------------------ epochs

    async def _run_once(self) -> None:
        start = await self._sync()
        if start is None:
            self.progress.finished = not self.progress.deleted
            return
        epochs: Iterator[int] = (
            iter(range(start, self.spec.epochs or 0)) if self.spec.finite else itertools.count(start)
        )
        for epoch in epochs:
            self.progress.epoch = epoch
            if not await self._produce_epoch(epoch):
                return  # stopped
            await self.redis.hset(
                streams.progress_key(self.spec.name), streams.PROGRESS_EPOCHS_DONE, str(epoch + 1)
            )
        if self.spec.finite and not self._stop.is_set():
            ends: dict[Any, Any] = {
                streams.progress_end_field(p): streams.format_id(pos).encode()
                for p, pos in enumerate(self._position) if pos is not None
            }
            await self.redis.hset(
                streams.progress_key(self.spec.name),
                mapping={**ends, streams.PROGRESS_FINISHED: b"1"},
            )
            self.progress.finished = True

    def _next_index(self, partition: int, epoch: int) -> int:
        pos = self._position[partition]
        if pos is None or epoch > pos[0] - 1:
            return 0
        if epoch == pos[0] - 1:
            return pos[1] + 1
        return _NEVER

    async def _produce_epoch(self, epoch: int) -> bool:
        """Append what is missing of ``epoch``; False when stopped before its end.

        ``connections`` writers (each with its own link) serve the partitions
        ``p % connections == w``: one writer per partition keeps its batches in order,
        and the number of connections stays bounded however many partitions there are.
        """
        writers = min(self.spec.partitions, self.connections)
        queues: list[_Queue] = [asyncio.Queue() for _ in range(writers)]
        budget = _ByteBudget(self.max_inflight_bytes)
        async with asyncio.TaskGroup() as tg:
            for w in range(writers):
                tg.create_task(
                    self._writer(queues[w], epoch, budget), name=f"write-{self.spec.name}-{w}"
                )
            complete = await self._read_epoch(epoch, queues, budget)
            for q in queues:
                q.put_nowait(None)
        return complete and not self._stop.is_set()

    async def _read_epoch(self, epoch: int, queues: list[_Queue], budget: _ByteBudget) -> bool:
        """Plan the epoch and hand each partition its batches. Memory: the shuffle buffer,
        one chunk, and at most ``max_inflight_bytes`` of batches not yet appended (the
        pending ones are flushed early when they would pass half of it)."""
        spec = self.spec
        partitions = spec.partitions
        chunks = plan_spec_chunks(spec, epoch, self.storage_options)
        next_index = [self._next_index(p, epoch) for p in range(partitions)]
        if min(next_index) == _NEVER:
            return True  # every partition is past this epoch
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

        while not self._stop.is_set():
            chunk: PlanChunk | None
            if self._inline_reads:
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
                size = sum(map(len, map(_DATA, records)))
                pending_bytes[p] += size
                pending_total += size
                while len(pending[p]) >= self.batch_records or pending_bytes[p] >= self.batch_bytes:
                    await hand_over(p, *_first_batch(pending[p], self.batch_records, self.batch_bytes))
            if pending_total > self.max_inflight_bytes // 2:
                for p in range(partitions):  # many partitions: do not hoard
                    if pending[p]:
                        await hand_over(p, len(pending[p]), pending_bytes[p])
            if chunk.dead:
                await self._dead_letters(chunk.dead, epoch)
        for p in range(partitions):
            if pending[p]:
                await hand_over(p, len(pending[p]), pending_bytes[p])
        return not self._stop.is_set()

    # ------------------------------------------------------------------ writing

    async def _writer(self, queue: _Queue, epoch: int, budget: _ByteBudget) -> None:
        link = Link(self.redis)
        verified: set[int] = set()
        broken = True
        try:
            await link.open()
            while (got := await queue.get()) is not None:
                p, first, batch, size = got
                try:
                    if p not in verified:
                        await self._verify(p, link)
                        verified.add(p)
                    if await self._wait_room(p, len(batch), size):
                        await self._write(p, first, batch, epoch, size, link)
                    # else: stopped while paused: drop the batch (it is re-planned next
                    # run) and keep draining, so that the reader never waits for us.
                finally:
                    budget.give(size)
            broken = False
        finally:
            await link.close(broken=broken)

    async def _verify(self, p: int, link: Link) -> None:
        """On the writer's own connection: the partition still ends where the producer
        thinks it does (no restart of Redis since the sync)."""
        raw = await link.call("EVAL", _lua.LAST_ID, 1, self._keys[p])
        known = self._position[p]
        if raw is None:
            if not self._may_create[p]:
                raise _StreamLost(f"partition {p} stream is gone")
            return
        last = streams.parse_id(raw)
        if known is not None and last < known:
            raise _StreamLost(f"partition {p} ends at {streams.format_id(last)}, "
                              f"before {streams.format_id(known)}")
        self._may_create[p] = False

    async def _write(
        self, p: int, first: int, batch: list[GoodRecord], epoch: int, size: int, link: Link
    ) -> None:
        """Pipelined ``XADD key NOMKSTREAM <id> ...`` of one batch on the writer's link.

        NOMKSTREAM: a stream that vanished (deleted, or lost with its Redis) is never
        re-created behind the producer's back. An XADD refused because its ID is not
        above the stream's last one means the entry is already there (another producer
        or a previous attempt); any other refusal fails the run."""
        parts: list[bytes] = []
        ms = epoch + 1
        xadd_records(parts, self._key_bulk[p], ms, first, batch, nomkstream=not self._may_create[p])
        replies = await link.send_many(parts, len(batch))
        if None in replies:
            raise _StreamLost(f"partition {p} stream is gone")
        errors = [r for r in replies if r.__class__ is not bytes]
        skipped = len(errors)
        added = len(batch) - skipped
        refused = errors[0] if errors else None
        last = (ms, first + len(batch) - 1)
        if refused is not None:
            raw = await link.call("EVAL", _lua.LAST_ID, 1, self._keys[p])
            if raw is None or streams.parse_id(raw) < last:
                raise refused
        self._position[p] = last
        self._may_create[p] = False
        self._backlogs[p].add((ms, first), last, len(batch), size)
        self.progress.records += added
        self.progress.skipped += skipped
        added_bytes = size * added // len(batch)
        self.progress.bytes += added_bytes
        self.metrics.records.labels(**self._labels).inc(added)
        self.metrics.bytes.labels(**self._labels).inc(added_bytes)
        self._set_lag(p)

    async def _append_entries(
        self, key: str, expected: str, entries: list[tuple[str, dict[bytes, bytes]]]
    ) -> tuple[int, int, int]:
        """One ``_lua.APPEND`` call: returns (added, skipped, 0) or the script's alarms."""
        args: list[bytes] = [expected.encode()]
        for stream_id, fields in entries:
            args.append(stream_id.encode())
            args.append(b"%d" % len(fields))
            for k, v in fields.items():
                args.append(k)
                args.append(v)
        result = await call_packed_script(
            self.redis, _lua.APPEND, self._append_sha, [key.encode()], args
        )
        added, skipped, seq = cast(list[int], result)
        return int(added), int(skipped), int(seq)

    async def _dead_letters(self, items: list[PlannedDeadLetter], epoch: int) -> None:
        entries = [
            (streams.make_id(epoch, item.index), streams.encode_dead_letter(
                item.record.reason, item.record.pos, item.record.payload,
                detail=item.record.detail, epoch=epoch,
            ))
            for item in items
        ]
        added, _skipped, _ = await self._append_entries(streams.dlq_key(self.spec.name), "", entries)
        # The script skips a prefix (entries already there) and adds the rest.
        for item in items[len(items) - added:]:
            self.metrics.dead_letters.labels(dataset=self.spec.name, reason=item.record.reason).inc()
        self.progress.dead_letters += added

    # ------------------------------------------------------------------ backpressure

    async def _refresh_committed(self, *, force: bool = False) -> dict[str, dict[int, str]]:
        async with self._committed_lock:
            now = asyncio.get_running_loop().time()
            if force or now - self._committed_at >= self.limits.poll_interval_s / 2:
                self._committed = await read_offsets(self.redis, self.spec.name, "committed")
                self._committed_at = now
            return self._committed

    def _advance(self, p: int, committed: Mapping[str, Mapping[int, str]]) -> None:
        self._backlogs[p].advance(min_committed(committed, p))
        self._set_lag(p)

    def _set_lag(self, p: int) -> None:
        labels = {"dataset": self.spec.name, "partition": str(p)}
        self.metrics.lag.labels(**labels).set(self._backlogs[p].entries)
        self.metrics.lag_bytes.labels(**labels).set(self._backlogs[p].bytes)

    async def _wait_room(self, p: int, count: int, size: int) -> bool:
        backlog = self._backlogs[p]
        if backlog.has_room(count, size, self.limits):
            return True
        self._advance(p, await self._refresh_committed())
        if backlog.has_room(count, size, self.limits):
            return True
        await self.redis.sadd(streams.paused_key(self.spec.name), str(p))
        self.progress.paused.add(p)
        self.metrics.pauses.labels(**self._labels).inc()
        self.metrics.paused.labels(**self._labels).set(len(self.progress.paused))
        log.info("dataset %s partition %d paused: backlog %d entries, %d bytes",
                 self.spec.name, p, backlog.entries, backlog.bytes)
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.limits.poll_interval_s)
                honour_cancel()
                if not await self.redis.exists(streams.meta_key(self.spec.name)):
                    # Deleted (or Redis lost it) while paused: the sync tells which.
                    raise _StreamLost(f"dataset {self.spec.name!r} is gone")
                self._advance(p, await self._refresh_committed())
                if backlog.has_room(count, size, self.limits):
                    await self.redis.srem(streams.paused_key(self.spec.name), str(p))
                    return True
            return False
        finally:
            self.progress.paused.discard(p)
            self.metrics.paused.labels(**self._labels).set(len(self.progress.paused))

    async def _clear_paused(self) -> None:
        with contextlib.suppress(*_RETRYABLE):
            await self.redis.delete(streams.paused_key(self.spec.name))

    # ------------------------------------------------------------------ maintenance

    async def _maintain(self, done: asyncio.Event) -> None:
        """Every interval, and once more after ``done``: advance backlogs to new commits,
        trim, export gauges (so a finished run leaves its partitions trimmed)."""
        while True:
            final = done.is_set()  # a pass that starts after the last append
            try:
                committed = await self._refresh_committed(force=True)
                for p in range(self.spec.partitions):
                    self._advance(p, committed)
                self._floors.update(await apply_retention(self.redis, self.spec, self.limits))
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key in self._keys:
                        pipe.xlen(key)
                    lengths = await pipe.execute()
                for p, n in enumerate(lengths):
                    self.metrics.backlog.labels(dataset=self.spec.name, partition=str(p)).set(n)
            except _RETRYABLE as exc:
                log.debug("dataset %s maintenance skipped: %s", self.spec.name, exc)
            if final:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), self.maintenance_interval_s)
