"""``StreamingDataset``: batches from a dataset's Redis partitions for one training run.

Each (rank, DataLoader worker) reads the partitions that
:func:`trainguard.core.streams.assign_partitions` gives it, through the run's consumer
group, with fenced Lua reads (see :mod:`trainer_client.offsets`). A pass starts where
the trainer's session says (the seek it writes before each pass), so batches that a
previous pass prefetched but the loop never consumed are read again, and nothing the
loop consumed is read twice.

Reading is :mod:`trainer_client._reader` (fenced reads, reconnects); turning replies
into batches is :mod:`trainer_client._stacking`.

Each yielded :class:`Batch` carries, per partition, the last stream ID it contains and
the IDs of its records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from redis.driver_info import DriverInfo
from torch.utils.data import IterableDataset, get_worker_info

from trainer_client import redis_client
from trainer_client._reader import LIB_VERSION, Reader
from trainer_client._stacking import Segment, decode_records, stack_arrays, take
from trainer_client.errors import DatasetNotFoundError
from trainer_client.redis_retry import trainer_redis_breaker, trainer_redis_retrier
from trainguard.core import streams

__all__ = ["Batch", "StreamingDataset", "in_worker_order", "load_spec"]


@dataclass
class Batch:
    """Records of one batch and where they came from.

    ``data`` is a tensor ``[n, ...]`` when every record is a NumPy array of one dtype
    and shape (copied once, straight from the Redis reply into the batch tensor), the
    ``collate`` result when one was given, else the list of decoded records.
    ``ids`` maps partition -> stream IDs of its records here, in stream order;
    ``offsets`` maps partition -> the last of them. In deterministic mode ``partition``
    is the one partition of the batch and ``seq`` its index among its worker's batches.
    """

    data: Any
    ids: dict[int, list[str]]
    offsets: dict[int, str]
    worker: int = 0
    partition: int = -1
    seq: int = -1
    final: bool = False
    """Deterministic mode: the worker's end-of-pass marker (no records)."""

    def __len__(self) -> int:
        return sum(len(v) for v in self.ids.values())


def load_spec(client: redis.Redis, dataset: str) -> streams.DatasetSpec:
    raw = client.hgetall(streams.meta_key(dataset))
    if not raw:
        raise DatasetNotFoundError(
            f"dataset {dataset!r} does not exist in Redis (expected its metadata at "
            f"{streams.meta_key(dataset)!r}): create it with the ingest service first, "
            "or check the Redis URL and the dataset name"
        )
    return streams.DatasetSpec.from_redis(raw)



_READ_BATCHES = 4
"""Greedy reads ask for about this many batches per round trip, spread over the
active partitions: enough to amortise the fenced read's round trips, small enough
that the reply's memory is reused from one read to the next rather than faulted in
afresh (a reply of many MiB costs more in page faults than it saves)."""


class StreamingDataset(IterableDataset[Batch]):
    """Batches of ``batch_size`` records from dataset ``dataset`` for run ``group``.

    Use with ``DataLoader(ds, batch_size=None, num_workers=N)`` (any N >= 0,
    persistent workers or not); usually made by ``TrainingSession.dataset``, which also
    supplies the fencing generation and the seeks. ``decode`` maps each decoded record
    (bytes, msgpack value or read-only NumPy view) to what the batch should hold;
    ``collate`` turns the list of those into the batch's ``data``.

    ``deterministic``: every batch holds ``batch_size`` consecutive records of one
    partition (fewer only at a partition's end) and a worker visits its partitions
    round-robin, so a resumed run (same world size and num_workers) yields exactly
    the batches an uninterrupted one would; it waits for slow partitions instead of
    reading whatever is ready.
    """

    def __init__(
        self,
        redis_url: str,
        dataset: str,
        group: str,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        decode: Callable[[Any], Any] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        deterministic: bool = False,
        generation: int = 0,
        block_ms: int = 1000,
        reconnect_timeout_s: float = 900.0,
        spec: streams.DatasetSpec | None = None,
    ) -> None:
        super().__init__()
        streams.check_name("dataset", dataset)
        streams.check_name("group", group)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if spec is None:
            client = redis_client.client(
                redis_url, socket_timeout=10, driver_info=DriverInfo(lib_version=LIB_VERSION)
            )
            call = trainer_redis_retrier(trainer_redis_breaker(f"redis:{group}"),
                                         reconnect_timeout_s).call
            try:
                spec = call(load_spec, client, dataset)
                call(client.sadd, streams.groups_key(dataset), group)
            finally:
                client.close()
        self.redis_url = redis_url
        self.dataset = dataset
        self.group = group
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.decode = decode
        self.collate = collate
        self.deterministic = deterministic
        self.generation = generation
        self.block_ms = block_ms
        self.reconnect_timeout_s = reconnect_timeout_s
        self.partitions = spec.partitions
        self.finite = spec.finite
        self.seek: dict[int, tuple[str, int]] | None = None
        """``{partition: (last consumed ID, batches consumed)}`` where the next pass
        starts; set by ``TrainingSession.batches`` before each pass."""
        self._passes = 0

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 0)
        owned = streams.assign_partitions(
            self.partitions,
            world_size=self.world_size,
            num_workers=num_workers,
            rank=self.rank,
            worker=worker,
        )
        reader = Reader(self, owned, consumer=f"r{self.rank}w{worker}")
        self._passes += 1
        # The seek set on this object is current in the main process and on a worker's
        # first pass (the worker got a copy of the object when it started). Persistent
        # workers' later passes read the seek the session recorded in Redis instead.
        seek = self.seek if (info is None or self._passes == 1) else None
        try:
            if owned:
                reader.start(seek)
            if self.deterministic:
                yield from self._deterministic(reader, worker, info is not None)
            else:
                yield from self._greedy(reader, worker, info is not None)
        finally:
            reader.close()

    def _greedy(self, reader: Reader, worker: int, in_worker: bool) -> Iterator[Batch]:
        bs = self.batch_size
        buf: deque[Segment] = deque()
        held = 0
        active = list(reader.partitions)
        while active:
            per = max(1, -(-bs * _READ_BATCHES // len(active)))
            got = reader.read({p: per for p in active})
            for p in active:
                ids, flats = got[p]
                if ids:
                    buf.append((p, ids, flats))
                    held += len(ids)
            while held >= bs:
                yield self._batch(take(buf, bs), worker, in_worker)
                held -= bs
            if any(got[p][0] for p in active):
                continue
            active = [p for p in active if not reader.finished(p)]
            if active:
                reader.wait(active)
        if buf:
            yield self._batch(list(buf), worker, in_worker)

    def _deterministic(self, reader: Reader, worker: int, in_worker: bool) -> Iterator[Batch]:
        bs = self.batch_size
        counts = {p: reader.batches.get(p, 0) for p in reader.partitions}
        active = sorted(reader.partitions)
        seq = sum(counts.values())
        while active:
            p = min(active, key=lambda q: (counts[q], q))
            chunk_ids: list[str] = []
            chunk_flats: list[list[bytes]] = []
            while len(chunk_ids) < bs:
                ids, flats = reader.read({p: bs - len(chunk_ids)})[p]
                chunk_ids += ids
                chunk_flats += flats
                if ids or len(chunk_ids) >= bs:
                    continue
                if reader.finished(p):
                    break
                reader.wait([p])
            if len(chunk_ids) < bs:
                active.remove(p)
            if chunk_ids:
                batch = self._batch([(p, chunk_ids, chunk_flats)], worker, in_worker)
                batch.partition, batch.seq = p, seq
                counts[p] += 1
                seq += 1
                yield batch
        yield Batch(data=[], ids={}, offsets={}, worker=worker, seq=seq, final=True)

    def _batch(self, segments: list[Segment], worker: int, in_worker: bool) -> Batch:
        ids: dict[int, list[str]] = {}
        for p, seg_ids, _ in segments:
            ids.setdefault(p, []).extend(seg_ids)
        offsets = {p: v[-1] for p, v in ids.items()}
        flats = segments[0][2] if len(segments) == 1 else [f for s in segments for f in s[2]]
        data: Any = None
        if self.decode is None and self.collate is None:
            data = stack_arrays(flats, in_worker)
        if data is None:
            records = decode_records(flats)
            if self.decode is not None:
                records = [self.decode(r) for r in records]
            data = self.collate(records) if self.collate is not None else records
        return Batch(data=data, ids=ids, offsets=offsets, worker=worker)


def in_worker_order(batches: Iterable[Batch], next_seq: dict[int, int]) -> Iterator[Batch]:
    """Deterministic mode: a DataLoader's batches in the order an uninterrupted run
    yields them, i.e. by (worker batch index, worker), whatever the loader's order.

    ``next_seq`` maps each worker to the index of its next batch (its batches already
    consumed). A resumed loader starts with worker 0 however far each worker had got;
    batches that come early wait here (at most about one per worker). A worker's
    ``final`` marker says it has no more; markers are not yielded."""
    nxt = dict(next_seq)
    alive = set(nxt)
    held: dict[tuple[int, int], Batch] = {}

    def ready() -> Iterator[Batch]:
        while True:
            keys = [(nxt[w], w) for w in nxt if w in alive or (nxt[w], w) in held]
            if not keys:
                return
            key = min(keys)
            if key not in held:
                return
            nxt[key[1]] += 1
            yield held.pop(key)

    for b in batches:
        if b.final:
            alive.discard(b.worker)
        else:
            held[(b.seq, b.worker)] = b
        yield from ready()
    alive.clear()
    yield from ready()
