"""``StreamingDataset``: batches from a dataset's Redis partitions for one training run.

Each (rank, DataLoader worker) reads the partitions that
:func:`trainguard.streams.assign_partitions` gives it, through the run's consumer
group, with fenced Lua reads (see :mod:`trainer_client.offsets`). A pass starts where
the trainer's session says (the seek it writes before each pass), so batches that a
previous pass prefetched but the loop never consumed are read again, and nothing the
loop consumed is read twice.

Connections are created lazily inside the iterating process (after the DataLoader
forks its workers) and dropped when the pass ends or is abandoned. Blocking waits use
their own socket timeout (longer than BLOCK) and, when Redis goes away, reconnect with
jittered backoff through a breaker (:mod:`trainer_client.retry`) and move the group
back to the last ID this worker received, so a reply lost in flight is delivered
again and entries Redis delivers twice (after an AOF rewind) are dropped by ID.

Each yielded :class:`Batch` carries, per partition, the last stream ID it contains and
the IDs of its records.
"""

from __future__ import annotations

import contextlib
import gc
import math
import operator
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
import torch
from redis.driver_info import DriverInfo
from torch.utils.data import IterableDataset, get_worker_info

from trainer_client import offsets as ofs
from trainer_client.errors import DatasetNotFoundError
from trainer_client.retry import REDIS_RETRY_ON, trainer_redis_breaker, trainer_redis_retrier
from trainguard import streams

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


def _fields(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    it = iter(flat)
    return dict(zip(it, it))


_Segment = tuple[int, list[str], list[list[bytes]]]
"""Consecutive entries of one partition: ``(partition, IDs, flat field lists)``, the
flat lists exactly as Redis sent them (``[name, value, name, value, ...]``)."""

_READ_BATCHES = 4
"""Greedy reads ask for about this many batches per round trip, spread over the
active partitions: enough to amortise the fenced read's round trips, small enough
that the reply's memory is reused from one read to the next rather than faulted in
afresh (a reply of many MiB costs more in page faults than it saves)."""

_READ_SIZE = 1 << 18
"""Socket read size of the reading connection: large replies come in fewer reads."""

_LIB_VERSION = redis.__version__
"""Passed to every connection: otherwise redis-py looks its own version up in the
package metadata for each one (milliseconds per pass)."""

_ENTRY_ID, _ENTRY_FIELDS = operator.itemgetter(0), operator.itemgetter(1)


def _take(segments: deque[_Segment], n: int) -> list[_Segment]:
    """The first ``n`` entries of ``segments`` (removed from it), still in segments."""
    out: list[_Segment] = []
    while n > 0:
        p, ids, flats = segments.popleft()
        if len(ids) > n:
            segments.appendleft((p, ids[n:], flats[n:]))
            ids, flats = ids[:n], flats[:n]
        out.append((p, ids, flats))
        n -= len(ids)
    return out


def _nd_layout(first: list[bytes]) -> tuple[int, Callable[[Any], Any], tuple[bytes, ...]] | None:
    """Where an ``nd`` record keeps its payload, and what every entry of a stackable
    batch must share with ``first`` (field names in order, kind, dtype, shape), as a
    getter and its value; None when ``first`` is no ``nd`` record with unique names."""
    names = first[0::2]
    if len(first) % 2 or len(set(names)) != len(names):
        return None
    where = {name: 2 * i + 1 for i, name in enumerate(names)}
    if not {streams.F_KIND, streams.F_DATA, streams.F_DTYPE} <= where.keys():
        return None
    if first[where[streams.F_KIND]] != streams.KIND_NDARRAY:
        return None
    shared = [*range(0, len(first), 2), where[streams.F_KIND], where[streams.F_DTYPE]]
    if streams.F_SHAPE in where:
        shared.append(where[streams.F_SHAPE])
    get = operator.itemgetter(*shared)
    return where[streams.F_DATA], get, get(first)


def _stack_arrays(flats: list[list[bytes]], in_worker: bool) -> torch.Tensor | None:
    """One tensor for same-shaped NumPy records, or None when they are not all that.

    Works on the flat field lists straight from the reply (no dict per entry): one
    C-level pass checks that every entry has the first one's field names, kind, dtype
    and shape; the payloads are then copied once, by one join, into the tensor's
    memory. A DataLoader worker copies them into shared memory instead, so the trip
    to the main process copies nothing more."""
    first = flats[0]
    layout = _nd_layout(first)
    if layout is None:
        return None
    data_at, shared, expected = layout
    if set(map(len, flats)) != {len(first)} or list(map(shared, flats)).count(expected) != len(flats):
        return None
    names = first[0::2]
    dt = first[2 * names.index(streams.F_DTYPE) + 1]
    sh = first[2 * names.index(streams.F_SHAPE) + 1] if streams.F_SHAPE in names else b""
    dtype = np.dtype(dt.decode())
    shape = tuple(int(n) for n in sh.decode().split(",")) if sh else ()
    try:
        tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except (TypeError, ValueError):  # no torch dtype (object, non-native byte order)
        return None
    step = dtype.itemsize * math.prod(shape)
    payloads = list(map(operator.itemgetter(data_at), flats))
    sizes = set(map(len, payloads))
    if sizes != {step}:
        bad = next(s for s in sizes if s != step)
        raise streams.ContractError(
            f"record of {bad} bytes does not match its dtype {dtype} and shape {shape}"
        )
    n = len(payloads)
    if in_worker or step == 0:
        out = torch.empty((n, *shape), dtype=tdtype)
        if in_worker:
            out.share_memory_()
        if step == 0:  # zero-sized records: nothing to copy (and no byte view exists)
            return out
        view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
        for i, data in enumerate(payloads):
            view[i * step : (i + 1) * step] = data
        return out
    # The joined bytearray is the tensor's memory (torch keeps it alive): one copy.
    return torch.frombuffer(bytearray().join(payloads), dtype=tdtype).view(n, *shape)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """A reply holds thousands of small containers; letting the cyclic GC scan them
    while they are built costs a large share of the read (none of them can form a
    cycle). Reference counting still frees everything."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Reader:
    """One worker's connection to its partitions, with reconnects."""

    def __init__(self, ds: StreamingDataset, partitions: list[int], consumer: str):
        self.ds = ds
        self.partitions = partitions
        self.consumer = consumer
        self.client: redis.Redis | None = None
        self.conn: redis.Connection | None = None
        self.positions: dict[int, str] = {}
        self.parsed: dict[int, streams.StreamId] = {}
        self.batches: dict[int, int] = {}
        self.ends: dict[int, str | None] | None = None
        self._commands: dict[tuple[tuple[int, int], ...], tuple[list[bytes], list[bytes]]] = {}
        # Made here, in the process that reads (a DataLoader worker): one per reader.
        self.breaker = trainer_redis_breaker(f"redis:{ds.group}:{consumer}")
        self.retrier = trainer_redis_retrier(self.breaker, ds.reconnect_timeout_s)

    def _connect(self) -> redis.Redis:
        if self.client is None:
            self.client = redis.Redis.from_url(
                self.ds.redis_url,
                socket_timeout=self.ds.block_ms / 1000 + 10.0,
                socket_connect_timeout=5.0,
                driver_info=DriverInfo(lib_version=_LIB_VERSION),
            )
        return self.client

    def _drop(self) -> None:
        # A connection cut off mid-command may still have a reply in flight: never
        # reuse it (this is what makes an interrupted blocking read safe).
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.conn is not None:
            self.conn.disconnect()
            self.conn = None

    def close(self) -> None:
        self._drop()

    def _retry(self, fn: Callable[[redis.Redis], Any], *, reseek: bool) -> Any:
        """Run ``fn`` against Redis through the reader's retrier (backoff and breaker
        over transient errors, reconnecting each time); after a reconnect, first move
        the group back to our own positions."""
        lost = False

        def attempt() -> Any:
            nonlocal lost
            try:
                client = self._connect()
                if lost and reseek and self.positions:
                    ofs.seek_group(
                        client, self.ds.dataset, self.ds.group, self.ds.generation, self.positions
                    )
                return fn(client)
            except REDIS_RETRY_ON:
                self._drop()
                lost = True
                raise

        try:
            # The first try goes straight through the breaker: setting up the backoff
            # costs more than a fast read, and it is only needed once one failed.
            return self.breaker.call(attempt)
        except REDIS_RETRY_ON:
            return self.retrier.call(attempt)

    def start(self, seek: dict[int, tuple[str, int]] | None) -> None:
        """Position the pass: at ``seek`` when given (the group is moved there), else at
        the seek the trainer recorded in Redis, else where the group stands."""
        ds = self.ds
        if seek is not None:
            positions = {p: seek[p][0] for p in self.partitions}
            self._retry(
                lambda c: ofs.seek_group(c, ds.dataset, ds.group, ds.generation, positions),
                reseek=False,
            )
            got = {p: seek[p] for p in self.partitions}
        else:
            got = self._retry(
                lambda c: ofs.start_pass(
                    c, ds.dataset, ds.group, ds.generation, self.partitions, use_seek=True
                ),
                reseek=False,
            )
        for p, (i, n) in got.items():
            self.positions[p] = i
            self.parsed[p] = streams.parse_id(i)
            self.batches[p] = n

    def _raw(self) -> redis.Connection:
        if self.conn is None:
            kw = redis.connection.parse_url(self.ds.redis_url)
            self.conn = redis.Connection(
                **kw, protocol=2, socket_timeout=30.0, socket_connect_timeout=5.0,
                socket_read_size=_READ_SIZE, driver_info=DriverInfo(lib_version=_LIB_VERSION),
            )
            self.conn.connect()
        return self.conn

    def _packed(self, conn: redis.Connection, counts: dict[int, int]) -> tuple[list[bytes], list[bytes]]:
        """The packed commands of a fenced read of ``counts``: WATCH and MGET of the
        fences, then MULTI, the XREADGROUPs and EXEC. They only depend on ``counts``,
        and packing them costs more client CPU than reading a reply of small records,
        so they are packed once per shape of read."""
        key = tuple(counts.items())
        got = self._commands.get(key)
        if got is None:
            ds = self.ds
            fences = [streams.fence_key(ds.dataset, p, ds.group) for p in counts]
            cmds: list[tuple[Any, ...]] = [("MULTI",)]
            for p, n in counts.items():
                cmds.append((
                    "XREADGROUP", "GROUP", ds.group, self.consumer, "COUNT", n,
                    "STREAMS", streams.partition_key(ds.dataset, p), ">",
                ))
            cmds.append(("EXEC",))
            got = (conn.pack_commands([("WATCH", *fences), ("MGET", *fences)]),
                   conn.pack_commands(cmds))
            if len(self._commands) >= 256:  # deterministic reads vary their counts
                self._commands.clear()
            self._commands[key] = got
        return got

    def _fenced_read(self, counts: dict[int, int]) -> dict[int, list[Any]]:
        """XREADGROUP of each partition in one MULTI, under WATCH of the partitions'
        fences: a trainer whose generation is no longer the newest reads nothing.

        Optimistic instead of a Lua script because Lua copies every reply into Lua
        values and back, which costs most of the throughput for large records.
        """
        ds = self.ds
        order = list(counts)
        while True:
            conn = self._raw()
            watch, read = self._packed(conn, counts)
            conn.send_packed_command(watch)
            conn.read_response()
            gens = [int(g or 0) for g in conn.read_response()]
            if max(gens) != ds.generation or min(gens) != ds.generation:
                conn.send_command("UNWATCH")
                conn.read_response()
                # Raises FencedError when newer; re-asserts a fence Redis lost.
                ofs.assert_generation(self._connect(), ds.dataset, ds.group, ds.generation, order)
                continue
            conn.send_packed_command(read)
            for _ in range(len(order) + 1):
                conn.read_response()  # OK, QUEUED...
            results = conn.read_response()
            if results is None:
                continue  # a fence changed under WATCH: look again
            missing = {p: self.positions[p] for p, r in zip(order, results)
                       if isinstance(r, Exception) and "NOGROUP" in str(r)}
            for r in results:
                if isinstance(r, Exception) and "NOGROUP" not in str(r):
                    raise r
            if missing:  # Redis lost the group (restart): recreate it where we are
                ofs.seek_group(self._connect(), ds.dataset, ds.group, ds.generation, missing)
                continue
            return {p: (r[0][1] if r else []) for p, r in zip(order, results)}

    def read(self, counts: dict[int, int]) -> dict[int, tuple[list[str], list[list[bytes]]]]:
        """Up to ``counts[p]`` new entries of each partition (possibly none), as their
        IDs and flat field lists, with the producer's end marks refreshed in the same
        round trip."""

        def call(c: redis.Redis) -> Any:
            got = self._fenced_read(counts)
            if self.ds.finite:
                self._refresh_ends(c)
            return got

        with _gc_paused():
            return self._parse(self._retry(call, reseek=True))

    def _parse(self, raw: dict[int, list[Any]]) -> dict[int, tuple[list[str], list[list[bytes]]]]:
        out: dict[int, tuple[list[str], list[list[bytes]]]] = {}
        for p, entries in raw.items():
            # IDs come in increasing order: only a head at or below our position can
            # be a repeat (Redis rewound its AOF and delivered them again).
            last = self.parsed[p]
            start = 0
            while start < len(entries) and streams.parse_id(entries[start][0]) <= last:
                start += 1
            if start:
                entries = entries[start:]
            # map() over C getters: no Python frame per entry.
            ids = list(map(bytes.decode, map(_ENTRY_ID, entries)))
            if ids:
                self.positions[p] = ids[-1]
                self.parsed[p] = streams.parse_id(ids[-1])
            out[p] = (ids, list(map(_ENTRY_FIELDS, entries)))
        return out

    def _refresh_ends(self, client: redis.Redis) -> None:
        if self.ends is not None:
            return
        prog = client.hgetall(streams.progress_key(self.ds.dataset))
        if prog.get(streams.PROGRESS_FINISHED) != b"1":
            return
        ends: dict[int, str | None] = {}
        for p in self.partitions:
            v = prog.get(streams.progress_end_field(p))
            ends[p] = v.decode() if isinstance(v, bytes) else v
        self.ends = ends

    def finished(self, p: int) -> bool:
        """True once the producer finished and we hold the partition's last entry."""
        if self.ends is None:
            return False
        end = self.ends[p]
        return end is None or self.parsed[p] >= streams.parse_id(end)

    def wait(self, partitions: list[int]) -> None:
        """Block until one of the partitions has entries after our position (or BLOCK
        passes). XREAD without a group changes nothing, so a wait that is cut off
        loses nothing."""
        keys: dict[Any, Any] = {
            streams.partition_key(self.ds.dataset, p): self.positions[p] for p in partitions
        }
        self._retry(lambda c: c.xread(keys, count=1, block=self.ds.block_ms), reseek=True)


class StreamingDataset(IterableDataset):
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
            client = redis.Redis.from_url(
                redis_url, socket_timeout=10, driver_info=DriverInfo(lib_version=_LIB_VERSION)
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
        reader = _Reader(self, owned, consumer=f"r{self.rank}w{worker}")
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

    def _greedy(self, reader: _Reader, worker: int, in_worker: bool) -> Iterator[Batch]:
        bs = self.batch_size
        buf: deque[_Segment] = deque()
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
                yield self._batch(_take(buf, bs), worker, in_worker)
                held -= bs
            if any(got[p][0] for p in active):
                continue
            active = [p for p in active if not reader.finished(p)]
            if active:
                reader.wait(active)
        if buf:
            yield self._batch(list(buf), worker, in_worker)

    def _deterministic(self, reader: _Reader, worker: int, in_worker: bool) -> Iterator[Batch]:
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

    def _batch(self, segments: list[_Segment], worker: int, in_worker: bool) -> Batch:
        ids: dict[int, list[str]] = {}
        for p, seg_ids, _ in segments:
            ids.setdefault(p, []).extend(seg_ids)
        offsets = {p: v[-1] for p, v in ids.items()}
        flats = segments[0][2] if len(segments) == 1 else [f for s in segments for f in s[2]]
        data: Any = None
        if self.decode is None and self.collate is None:
            data = _stack_arrays(flats, in_worker)
        if data is None:
            records = [streams.decode_record(_fields(f)) for f in flats]
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
