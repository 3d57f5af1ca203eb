"""``StreamingDataset``: batches from a dataset's Redis partitions for one training run.

Each (rank, DataLoader worker) reads the partitions that
:func:`trainguard.core.streams.assign_partitions` gives it, through the run's consumer
group, with fenced reads (see :mod:`trainer_client._reader`). A pass starts where
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
from collections.abc import Callable, Iterator
from typing import Any

import redis
from redis.driver_info import DriverInfo
from torch.utils.data import IterableDataset, get_worker_info

from trainer_client import _rng, redis_client
from trainer_client._reader import LIB_VERSION, Reader, ReadSpec
from trainer_client._stacking import Segment, decode_records, positions, stack_arrays, take
from trainer_client.batch import Batch
from trainer_client.errors import SessionBypassedError
from trainer_client.redis_retry import trainer_redis_breaker, trainer_redis_retrier
from trainguard.core import streams

__all__ = ["Batch", "StreamingDataset", "load_spec"]


def load_spec(client: redis.Redis, dataset: str) -> streams.DatasetSpec:
    return streams.DatasetSpec.of_meta(dataset, client.hgetall(streams.meta_key(dataset)))



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

    ``deterministic``: a batch holds ``batch_size`` consecutive records of one
    partition, a worker visits its partitions round-robin, and where a partition's
    epoch ends mid-batch the batch is filled from the worker's next partitions (see
    :meth:`_deterministic`), so a resumed run (same world size and num_workers) yields exactly
    the batches an uninterrupted one would; it waits for slow partitions instead of
    reading whatever is ready. In a DataLoader worker, ``decode`` and ``collate`` run
    with random generators seeded per batch from ``seed`` (random augmentation is
    then the same on a resume). Greedy (the default here; ``TrainingSession``
    defaults to deterministic) mixes whatever partitions are ready into a batch.

    Epochs: a batch holds records of one epoch, from as many of the worker's
    partitions as it needs: only the worker's last batch of an epoch may be short, or,
    with ``drop_last``, is consumed without being yielded (its records
    count as read: never trained, never read again). ``straddle_epochs=True`` lets
    batches run across epoch boundaries instead (every batch full but the last).
    ``epochs`` reads only the first that many epochs (at most the dataset's own, any
    number of an endless one): the pass ends after them, and records of later epochs
    are left unread for this run. The producer writes an endless dataset's epochs as
    the backlog drains, so the trainer's ``epochs`` is what gets produced for it.
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
        drop_last: bool = False,
        straddle_epochs: bool = False,
        epochs: int | None = None,
        seed: int = 0,
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
        self.redis_url = redis_url
        self.block_ms = block_ms
        self._clients = redis_client.ProcessClient(
            redis_url, socket_timeout=block_ms / 1000 + 10.0, socket_connect_timeout=5.0,
            driver_info=DriverInfo(lib_version=LIB_VERSION),
        )
        if spec is None:
            call = trainer_redis_retrier(trainer_redis_breaker(f"redis:{group}"),
                                         reconnect_timeout_s).call
            try:
                spec = call(load_spec, self.redis(), dataset)
                call(self.redis().sadd, streams.groups_key(dataset), group)
            except BaseException:
                self.drop_redis()
                raise
        self.dataset = dataset
        self.group = group
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.decode = decode
        self.collate = collate
        self.deterministic = deterministic
        self.drop_last = drop_last
        self.straddle_epochs = straddle_epochs
        self.generation = generation
        self.reconnect_timeout_s = reconnect_timeout_s
        if epochs is not None and (epochs < 1 or (spec.epochs is not None and epochs > spec.epochs)):
            raise ValueError(
                f"epochs={epochs} is not available: dataset {dataset!r} has "
                f"{spec.epochs if spec.finite else 'endless'} epochs; ask for 1 to "
                f"{spec.epochs if spec.finite else 'any number'}, or re-ingest it with "
                "more (--epochs 0: endless)"
            )
        if epochs is not None and not spec.replayable:
            raise ValueError(f"dataset {dataset!r} is a push dataset: it has no epochs to count")
        self.epochs = epochs
        self.seed = seed
        self.partitions = spec.partitions
        self.finite = spec.finite or epochs is not None
        self.replayable = spec.replayable
        self.session_made = False
        """True when made by ``TrainingSession.dataset``: then a pass that the
        session did not start (no seek) is refused, see SessionBypassedError."""
        self.seek: dict[int, tuple[str, int]] | None = None
        """``{partition: (last consumed ID, batches consumed)}`` where the next pass
        starts; set by ``TrainingSession.batches`` before each pass."""
        self._passes = 0

    # ------------------------------------------------------------------ Redis

    def redis(self) -> redis.Redis:
        """This process's client of the dataset's Redis (see ProcessClient): kept
        across passes; a DataLoader worker makes its own."""
        return self._clients.get()

    def drop_redis(self) -> None:
        """Close this process's client (after a connection error)."""
        self._clients.drop()

    def read_spec(self) -> ReadSpec:
        """What a pass's reader needs of this dataset, as it stands now (the session's
        restore hands the dataset a new generation after it was made)."""
        return ReadSpec(
            redis_url=self.redis_url, dataset=self.dataset, group=self.group,
            generation=self.generation, block_ms=self.block_ms,
            reconnect_timeout_s=self.reconnect_timeout_s, finite=self.finite,
            epochs=self.epochs,
        )

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
        reader = Reader(self.read_spec(), self._clients, owned, consumer=f"r{self.rank}w{worker}")
        self._passes += 1
        # The seek set on this object is current in the main process and on a worker's
        # first pass (the worker got a copy of the object when it started). Persistent
        # workers' later passes read the seek the session recorded in Redis instead.
        seek = self.seek if (info is None or self._passes == 1) else None
        if seek is None and self.session_made and (info is None or self._passes == 1):
            raise SessionBypassedError(
                "this dataset was made by TrainingSession.dataset but is iterated "
                "outside session.batches(): the session would never see what the loop "
                "consumed, and its checkpoints would commit offsets that make a restart "
                "train those records again. Iterate `session.batches(loader)` instead "
                "of the loader"
            )
        try:
            if owned:
                reader.start(seek)
            if self.deterministic:
                yield from self._deterministic(reader, worker, info is not None)
            else:
                yield from self._greedy(reader, worker, info is not None)
        finally:
            reader.close()

    def _epoch(self, stream_id: str) -> int:
        """The epoch of a record (0 for push datasets: their IDs are timestamps)."""
        return int(stream_id.split("-", 1)[0]) - 1 if self.replayable else 0

    def _cut(self, stream_id: str) -> int:
        """Records of different values here never share a batch."""
        return 0 if self.straddle_epochs else self._epoch(stream_id)

    def _by_epoch(self, p: int, ids: list[str], flats: list[list[bytes]]) -> list[tuple[int, Segment]]:
        """A partition's read, split where its records change epoch (rarely)."""
        first, last = self._cut(ids[0]), self._cut(ids[-1])
        if first == last:
            return [(first, (p, ids, flats))]
        out: list[tuple[int, Segment]] = []
        lo = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or self._cut(ids[i]) != self._cut(ids[lo]):
                out.append((self._cut(ids[lo]), (p, ids[lo:i], flats[lo:i])))
                lo = i
        return out

    def _tail(self, segments: list[Segment], worker: int, in_worker: bool) -> Batch:
        """The short last batch of an epoch: yielded, or consumed unseen (drop_last)."""
        if self.drop_last:
            ids: dict[int, list[str]] = {}
            for p, seg_ids, _ in segments:
                ids.setdefault(p, []).extend(seg_ids)
            return Batch(data=None, ids=ids, offsets={p: v[-1] for p, v in ids.items()},
                         worker=worker, epoch=self._epoch(segments[0][1][0]), dropped=True)
        return self._batch(segments, worker, in_worker)

    def _greedy(self, reader: Reader, worker: int, in_worker: bool) -> Iterator[Batch]:
        bs = self.batch_size
        bufs: dict[int, deque[Segment]] = {}
        held: dict[int, int] = {}
        active = list(reader.partitions)
        while active:
            per = max(1, -(-bs * _READ_BATCHES // len(active)))
            got = reader.read({p: per for p in active}, ahead=True)
            for p in active:
                ids, flats = got[p]
                if ids:
                    for e, seg in self._by_epoch(p, ids, flats):
                        bufs.setdefault(e, deque()).append(seg)
                        held[e] = held.get(e, 0) + len(seg[1])
            for e in sorted(bufs):
                while held[e] >= bs:
                    yield self._batch(take(bufs[e], bs), worker, in_worker)
                    held[e] -= bs
            if any(got[p][0] for p in active):
                continue
            active = [p for p in active if not reader.finished(p)]
            # An epoch's short tail goes once no active partition can add to it.
            reached = min((self._cut(reader.positions[p]) for p in active), default=None)
            for e in sorted(bufs):
                if bufs[e] and (reached is None or e < reached):
                    yield self._tail(list(bufs.pop(e)), worker, in_worker)
                    held.pop(e)
            if active:
                reader.wait(active)

    def _deterministic(self, reader: Reader, worker: int, in_worker: bool) -> Iterator[Batch]:
        """Batches in an order that is a function of the data and the consumed state
        alone (each partition's last consumed ID and the batches it led), so a resume
        at any batch yields what an uninterrupted pass would have.

        The worker reads epoch by epoch (all its partitions' records of one epoch
        before any of the next). A batch is led by the partition of that epoch that
        led fewest batches (then the lowest number) and takes ``batch_size``
        consecutive records of it; when the lead's epoch ends first, the batch goes on
        with the next partitions in that order. So only the worker's last batch of an
        epoch can be short."""
        bs = self.batch_size
        counts = {p: reader.batches.get(p, 0) for p in reader.partitions}
        heads: dict[int, tuple[list[str], list[list[bytes]]]] = {}
        active = sorted(reader.partitions)
        seq = sum(counts.values())
        while True:
            active, e = self._current_cut(reader, heads, active)
            if e is None:
                break
            # Every partition that may hold records of cut e, in lead order; one not
            # read ahead is read when its turn comes (waiting for data, as a
            # round-robin reader does), and gives nothing when its next cut is later.
            order = sorted((q for q in active if self._low(reader, heads, q) == e),
                           key=lambda q: (counts[q], q))
            segs: list[Segment] = []
            need = bs
            for q in order:
                ids, flats = self._take_cut(reader, heads, q, e, need)
                if ids:
                    segs.append((q, ids, flats))
                    need -= len(ids)
                if not need:
                    break
            lead = segs[0][0]
            if in_worker and (self.decode is not None or self.collate is not None):
                # Random draws of decode/collate: a function of the batch alone.
                _rng.seed_batch(self.seed, lead, counts[lead])
            batch = (self._batch(segs, worker, in_worker) if not need
                     else self._tail(segs, worker, in_worker))
            batch.partition, batch.seq = lead, seq
            counts[lead] += 1
            seq += 1
            yield batch
        yield Batch(data=[], ids={}, offsets={}, worker=worker, seq=seq, final=True)

    def _low(self, reader: Reader, heads: dict[int, tuple[list[str], list[list[bytes]]]],
             q: int) -> int:
        """The lowest cut partition ``q``'s next record can have: that of the record
        read ahead, else that of its last consumed one (IDs only grow)."""
        return self._cut(heads[q][0][0] if q in heads else reader.positions[q])

    def _current_cut(self, reader: Reader, heads: dict[int, tuple[list[str], list[list[bytes]]]],
                     active: list[int]) -> tuple[list[int], int | None]:
        """The partitions left and the lowest cut (epoch) any of them has a record of:
        the lowest bound of :meth:`_low`, once a record read ahead has it (until then
        the partitions at that bound are read, waiting when none has data)."""
        while True:
            active = [q for q in active if q in heads or not reader.finished(q)]
            if not active:
                return active, None
            low = {q: self._low(reader, heads, q) for q in active}
            e = min(low.values())
            if any(q in heads for q in active if low[q] == e):
                return active, e
            unknown = [q for q in active if low[q] == e]
            got = reader.read({q: self.batch_size for q in unknown})
            for q in unknown:
                if got[q][0]:
                    heads[q] = got[q]
            waiting = [q for q in unknown if not reader.finished(q)]
            if waiting and not any(q in heads for q in unknown):
                reader.wait(waiting)

    def _take_cut(self, reader: Reader, heads: dict[int, tuple[list[str], list[list[bytes]]]],
                  q: int, e: int, n: int) -> tuple[list[str], list[list[bytes]]]:
        """Up to ``n`` next records of partition ``q`` of cut ``e`` (fewer once its
        records of ``e`` end); records read past them stay in ``heads``."""
        ids: list[str] = []
        flats: list[list[bytes]] = []
        while len(ids) < n:
            if q not in heads:
                got_ids, got_flats = reader.read({q: n - len(ids)})[q]
                if not got_ids:
                    if reader.finished(q):
                        break
                    reader.wait([q])
                    continue
                heads[q] = (got_ids, got_flats)
            h_ids, h_flats = heads.pop(q)
            k = min(n - len(ids), len(h_ids))
            if self._cut(h_ids[k - 1]) != e:
                k = next(i for i, x in enumerate(h_ids) if self._cut(x) != e)
            ids += h_ids[:k]
            flats += h_flats[:k]
            if k < len(h_ids):
                heads[q] = (h_ids[k:], h_flats[k:])
                if self._cut(h_ids[k]) != e:
                    break
        return ids, flats

    def _batch(self, segments: list[Segment], worker: int, in_worker: bool) -> Batch:
        ids: dict[int, list[str]] = {}
        for p, seg_ids, _ in segments:
            ids.setdefault(p, []).extend(seg_ids)
        offsets = {p: v[-1] for p, v in ids.items()}
        flats = segments[0][2] if len(segments) == 1 else [f for s in segments for f in s[2]]
        epoch = self._epoch(segments[0][1][0])
        data: Any = None
        if self.decode is None and self.collate is None:
            data = stack_arrays(flats, in_worker)
        if data is None:
            records = decode_records(flats)
            if self.decode is not None:
                records = [self.decode(r) for r in records]
            data = self.collate(records) if self.collate is not None else records
        return Batch(data=data, ids=ids, offsets=offsets, worker=worker, epoch=epoch,
                     pos=positions(flats))
