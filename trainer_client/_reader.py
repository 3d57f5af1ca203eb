"""One DataLoader worker's (or one process's) fenced reads of its partitions.

Each read is XREADGROUP of the worker's partitions in one MULTI, under WATCH of their
fences (a trainer whose generation is no longer the newest reads nothing), with the
producer's end marks refreshed in the same round trip. Connections are made in the
reading process (after the DataLoader forks) and dropped when the pass ends; a lost
connection reconnects through the breaker and retrier of
:mod:`trainer_client.redis_retry` and first moves the group back to the last ID this
worker received, so a reply lost in flight is delivered again and entries Redis
delivers twice (after an AOF rewind) are dropped by ID.
"""

from __future__ import annotations

import contextlib
import gc
import operator
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import redis
from redis.driver_info import DriverInfo

from trainer_client import offsets as ofs
from trainer_client import redis_client
from trainer_client.redis_retry import REDIS_RETRY_ON, trainer_redis_breaker, trainer_redis_retrier
from trainguard.core import redis_url, streams

if TYPE_CHECKING:
    from trainer_client.dataset import StreamingDataset

__all__ = ["LIB_VERSION", "Reader"]

_READ_SIZE = 1 << 18
"""Socket read size of the reading connection: large replies come in fewer reads."""

LIB_VERSION = redis.__version__
"""Passed to every connection: otherwise redis-py looks its own version up in the
package metadata for each one (milliseconds per pass)."""

_ENTRY_ID, _ENTRY_FIELDS = operator.itemgetter(0), operator.itemgetter(1)
_MAX_SEQ = 2**64 - 1


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


class Reader:
    """One worker's connection to its partitions, with reconnects."""

    def __init__(self, ds: StreamingDataset, partitions: list[int], consumer: str):
        self.ds = ds
        self.partitions = partitions
        self.consumer = consumer
        self.client: redis.Redis | None = None
        self.conn: redis.Connection | None = None
        # On a cluster: one connection per partition, to the master of its slot (see
        # _fenced_read_slots).
        self.slot_conns: dict[int, redis.Connection] = {}
        self.positions: dict[int, str] = {}
        self.parsed: dict[int, streams.StreamId] = {}
        self.batches: dict[int, int] = {}
        self.ends: dict[int, str | None] | None = None
        self._commands: dict[tuple[tuple[int, int], ...], tuple[list[bytes], list[bytes]]] = {}
        # Made here, in the process that reads (a DataLoader worker): one per reader.
        self.cluster = redis_url.parse(ds.redis_url).cluster
        self.breaker = trainer_redis_breaker(f"redis:{ds.group}:{consumer}")
        self.retrier = trainer_redis_retrier(self.breaker, ds.reconnect_timeout_s)

    def _connect(self) -> redis.Redis:
        if self.client is None:
            self.client = redis_client.client(
                self.ds.redis_url,
                socket_timeout=self.ds.block_ms / 1000 + 10.0,
                socket_connect_timeout=5.0,
                driver_info=DriverInfo(lib_version=LIB_VERSION),
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
        for conn in self.slot_conns.values():
            conn.disconnect()
        self.slot_conns.clear()

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
                socket_read_size=_READ_SIZE, driver_info=DriverInfo(lib_version=LIB_VERSION),
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

    def _slot_conn(self, p: int) -> redis.Connection:
        conn = self.slot_conns.get(p)
        if conn is None:
            cluster: Any = self._connect()
            node = cluster.get_node_from_key(streams.partition_key(self.ds.dataset, p))
            conn = redis.Connection(
                host=node.host, port=node.port, username=cluster.get_connection_kwargs().get("username"),
                password=cluster.get_connection_kwargs().get("password"), protocol=2,
                socket_timeout=30.0, socket_connect_timeout=5.0, socket_read_size=_READ_SIZE,
                driver_info=DriverInfo(lib_version=LIB_VERSION),
            )
            conn.connect()
            self.slot_conns[p] = conn
        return conn

    def _fenced_read_slots(self, counts: dict[int, int]) -> dict[int, list[Any]]:
        """The cluster's fenced read: a transaction may only touch one slot, so each
        partition gets its own WATCH of its fence and its own MULTI/XREADGROUP/EXEC, on
        its own connection to its slot's master. All partitions' commands are written
        before any reply is read, so a read still costs two round trips, not two per
        partition. A MOVED/ASK (the slot moved, a failover) is transient: the reader
        drops every connection and looks the slots up again."""
        ds = self.ds
        out: dict[int, list[Any]] = {}
        pending = list(counts)
        while pending:
            conns = {p: self._slot_conn(p) for p in pending}
            for p, conn in conns.items():
                fence = streams.fence_key(ds.dataset, p, ds.group)
                conn.send_packed_command(conn.pack_commands([("WATCH", fence), ("GET", fence)]))
            gens = {}
            for p, conn in conns.items():
                conn.read_response()
                gens[p] = int(conn.read_response() or 0)
            if any(g != ds.generation for g in gens.values()):
                for conn in conns.values():
                    conn.send_command("UNWATCH")
                for conn in conns.values():
                    conn.read_response()
                ofs.assert_generation(self._connect(), ds.dataset, ds.group, ds.generation, pending)
                continue
            for p, conn in conns.items():
                conn.send_packed_command(conn.pack_commands([
                    ("MULTI",),
                    ("XREADGROUP", "GROUP", ds.group, self.consumer, "COUNT", counts[p],
                     "STREAMS", streams.partition_key(ds.dataset, p), ">"),
                    ("EXEC",),
                ]))
            again, missing = [], {}
            for p, conn in conns.items():
                conn.read_response()
                conn.read_response()
                results = conn.read_response()
                if results is None:
                    again.append(p)  # its fence changed under WATCH: look again
                    continue
                (r,) = results
                if isinstance(r, Exception):
                    if "NOGROUP" not in str(r):
                        raise r
                    missing[p] = self.positions[p]
                    again.append(p)
                    continue
                out[p] = r[0][1] if r else []
            if missing:  # Redis lost the group (restart, failover): recreate it where we are
                ofs.seek_group(self._connect(), ds.dataset, ds.group, ds.generation, missing)
            pending = again
        return {p: out[p] for p in counts}

    def _fenced_read(self, counts: dict[int, int]) -> dict[int, list[Any]]:
        """XREADGROUP of each partition in one MULTI, under WATCH of the partitions'
        fences: a trainer whose generation is no longer the newest reads nothing.

        Optimistic instead of a Lua script because Lua copies every reply into Lua
        values and back, which costs most of the throughput for large records.
        """
        if self.cluster:
            return self._fenced_read_slots(counts)
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
            limit = self.ds.epochs
            if limit is not None and entries and streams.parse_id(entries[-1][0])[0] > limit:
                # Past the epochs this pass reads: never handed on, never consumed.
                entries = [e for e in entries if streams.parse_id(e[0])[0] <= limit]
            # map() over C getters: no Python frame per entry.
            ids = list(map(bytes.decode, map(_ENTRY_ID, entries)))
            if ids:
                self.positions[p] = ids[-1]
                self.parsed[p] = streams.parse_id(ids[-1])
            out[p] = (ids, list(map(_ENTRY_FIELDS, entries)))
        return out

    def _refresh_ends(self, client: redis.Redis) -> None:
        """Learn each partition's last entry for this pass, once it is known: the
        producer's end marks of a finished dataset, or, when the pass reads only the
        first ``ds.epochs`` epochs, the last entry of those once they are written."""
        if self.ends is not None:
            return
        prog = client.hgetall(streams.progress_key(self.ds.dataset))
        finished = prog.get(streams.PROGRESS_FINISHED) == b"1"
        limit = self.ds.epochs
        if limit is None:
            if finished:
                ends: dict[int, str | None] = {}
                for p in self.partitions:
                    v = prog.get(streams.progress_end_field(p))
                    ends[p] = v.decode() if isinstance(v, bytes) else v
                self.ends = ends
            return
        if finished or int(prog.get(streams.PROGRESS_EPOCHS_DONE, b"0") or 0) >= limit:
            pipe = client.pipeline(transaction=False)
            for p in self.partitions:
                pipe.xrevrange(streams.partition_key(self.ds.dataset, p),
                               max=f"{limit}-{_MAX_SEQ}", min="0-1", count=1)
            self.ends = {p: got[0][0].decode() if got else None
                         for p, got in zip(self.partitions, pipe.execute())}

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
        self._retry(lambda c: redis_client.wait_any(c, keys, self.ds.block_ms), reseek=True)

