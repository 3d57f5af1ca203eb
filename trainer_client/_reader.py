"""One DataLoader worker's (or one process's) fenced reads of its partitions.

Each read is XREADGROUP of the worker's partitions, pipelined on one connection per
server, on connections that checked the partitions' fences when opened and that a newer
trainer's restore closes (a trainer whose generation is no longer the newest reads
nothing; see :meth:`Reader._fenced_read`). Connections are made in the
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
from dataclasses import dataclass
from typing import Any, Protocol

import redis
from redis.driver_info import DriverInfo

from trainer_client import offsets as ofs
from trainer_client import redis_client
from trainer_client.redis_retry import REDIS_RETRY_ON, trainer_redis_breaker, trainer_redis_retrier
from trainguard.core import redis_url, streams

__all__ = ["LIB_VERSION", "ClientFactory", "ReadSpec", "Reader"]

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


@dataclass(frozen=True)
class ReadSpec:
    """What a pass reads: the dataset's partitions in ``redis_url`` for run ``group``
    at fencing ``generation``. ``finite``: the pass ends (the producer's end marks are
    watched); ``epochs``: only that many are read (None: all)."""

    redis_url: str
    dataset: str
    group: str
    generation: int
    block_ms: int
    reconnect_timeout_s: float
    finite: bool
    epochs: int | None


class ClientFactory(Protocol):
    """The reading process's Redis client (``get``) and its disposal after a
    connection error (``drop``), e.g. :class:`trainer_client.redis_client.ProcessClient`."""

    def get(self) -> redis.Redis: ...

    def drop(self) -> None: ...


class Reader:
    """One worker's connection to its partitions, with reconnects."""

    def __init__(self, spec: ReadSpec, clients: ClientFactory, partitions: list[int],
                 consumer: str):
        self.spec = spec
        self.clients = clients
        self.partitions = partitions
        self.consumer = consumer
        # One reading connection per server (the one, or each master the partitions
        # live on), and the partitions whose fences each has checked (see _node).
        self.node_conns: dict[tuple[str, int], redis.Connection] = {}
        self.checked: dict[tuple[str, int], set[int]] = {}
        self.where: dict[int, tuple[str, int]] = {}
        # A read sent ahead (see _fenced_read): what went where, and entries it
        # delivered that no read has returned yet.
        self.inflight: dict[tuple[str, int], list[tuple[int, int]]] | None = None
        self.stash: dict[int, list[Any]] = {}
        self.positions: dict[int, str] = {}
        self.parsed: dict[int, streams.StreamId] = {}
        self.batches: dict[int, int] = {}
        self.ends: dict[int, str | None] | None = None
        self._commands: dict[tuple[Any, ...], list[bytes]] = {}
        # Made here, in the process that reads (a DataLoader worker): one per reader.
        self.cluster = redis_url.parse(spec.redis_url).cluster
        self.breaker = trainer_redis_breaker(f"redis:{spec.group}:{consumer}")
        self.retrier = trainer_redis_retrier(self.breaker, spec.reconnect_timeout_s)

    def _connect(self) -> redis.Redis:
        return self.clients.get()

    def _drop(self) -> None:
        # A connection cut off mid-command may still have a reply in flight: never
        # reuse it (this is what makes an interrupted blocking read safe).
        self.clients.drop()
        self._close_nodes()

    def _close_nodes(self) -> None:
        for conn in self.node_conns.values():
            conn.disconnect()
        self.node_conns.clear()
        self.checked.clear()
        self.where.clear()  # a slot may have moved (failover, resharding)
        self.inflight = None  # its replies die with the connections
        self.stash.clear()

    def close(self) -> None:
        """End of the pass: the reading connections go (the dataset's client stays for
        the next pass)."""
        self._close_nodes()

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
                        client, self.spec.dataset, self.spec.group, self.spec.generation,
                        self.positions, what="read",
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
        spec = self.spec
        if seek is not None:
            positions = {p: seek[p][0] for p in self.partitions}
            self._retry(
                lambda c: ofs.seek_group(c, spec.dataset, spec.group, spec.generation, positions),
                reseek=False,
            )
            got = {p: seek[p] for p in self.partitions}
        else:
            got = self._retry(
                lambda c: ofs.start_pass(
                    c, spec.dataset, spec.group, spec.generation, self.partitions, use_seek=True
                ),
                reseek=False,
            )
        for p, (i, n) in got.items():
            self.positions[p] = i
            self.parsed[p] = streams.parse_id(i)
            self.batches[p] = n

    # ------------------------------------------------------------------ the read path

    def _node_of(self, p: int) -> tuple[str, int]:
        """Where partition ``p`` is served: the one server, or its slot's master."""
        addr = self.where.get(p)
        if addr is None:
            if self.cluster:
                cluster: Any = self._connect()
                node = cluster.get_node_from_key(streams.partition_key(self.spec.dataset, p))
                addr = (node.host, node.port)
            else:
                addr = ("", 0)
            self.where[p] = addr
        return addr

    def _open(self, addr: tuple[str, int]) -> redis.Connection:
        """A reading connection to ``addr``, named for eviction (see offsets.evict_readers)."""
        spec = self.spec
        kw: dict[str, Any] = dict(
            protocol=2, socket_timeout=30.0, socket_connect_timeout=5.0,
            socket_read_size=_READ_SIZE, driver_info=DriverInfo(lib_version=LIB_VERSION),
            client_name=ofs.reader_name(spec.dataset, spec.group, spec.generation),
        )
        if self.cluster:
            cluster: Any = self._connect()
            auth = cluster.get_connection_kwargs()
            kw.update(host=addr[0], port=addr[1], username=auth.get("username"),
                      password=auth.get("password"))
        else:
            kw.update(redis.connection.parse_url(spec.redis_url))
        conn = redis.Connection(**kw)
        conn.connect()
        return conn

    def _node(self, addr: tuple[str, int], partitions: list[int]) -> redis.Connection:
        """The connection to ``addr``, its fences checked for ``partitions``.

        A fence is checked once per connection, after the connection is named: a
        connection opened before a newer trainer's restore is closed by it
        (offsets.evict_readers) and one opened after sees the newer fence here, so a
        read never runs on a connection of an older generation once the newer
        trainer moved the group."""
        spec = self.spec
        while True:
            conn = self.node_conns.get(addr)
            if conn is not None and not conn.is_connected:
                # Closed by an error raised elsewhere: redis-py would reconnect it on
                # the next send, with its fences unchecked. Open a checked one.
                del self.node_conns[addr]
                conn = None
            if conn is None:
                conn = self.node_conns[addr] = self._open(addr)
                self.checked[addr] = set()
            checked = self.checked[addr]
            todo = [p for p in partitions if p not in checked]
            if not todo:
                return conn
            conn.send_packed_command(conn.pack_commands(
                [("GET", streams.fence_key(spec.dataset, p, spec.group)) for p in todo]))
            wrong = [p for p in todo if int(conn.read_response() or 0) != spec.generation]
            if not wrong:
                checked.update(todo)
                return conn
            # Raises FencedError when newer; re-asserts a fence Redis lost (then look again).
            ofs.assert_generation(self._connect(), spec.dataset, spec.group, spec.generation, wrong)

    def _packed(self, conn: redis.Connection, addr: tuple[str, int], counts: list[tuple[int, int]]) -> list[bytes]:
        """The XREADGROUPs of one server's partitions, packed once per shape of read:
        packing costs more client CPU than reading a reply of small records."""
        key = (addr, *counts)
        got = self._commands.get(key)
        if got is None:
            spec = self.spec
            got = conn.pack_commands([
                ("XREADGROUP", "GROUP", spec.group, self.consumer, "COUNT", n,
                 "STREAMS", streams.partition_key(spec.dataset, p), ">")
                for p, n in counts
            ])
            if len(self._commands) >= 256:  # deterministic reads vary their counts
                self._commands.clear()
            self._commands[key] = got
        return got

    def _send(self, counts: dict[int, int]) -> dict[tuple[str, int], list[tuple[int, int]]]:
        """Write the XREADGROUPs of ``counts``, one pipeline per server; returns what was
        sent where, for :meth:`_receive`."""
        sent: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for p, n in counts.items():
            sent.setdefault(self._node_of(p), []).append((p, n))
        conns = {addr: self._node(addr, [p for p, _ in todo]) for addr, todo in sent.items()}
        for addr, todo in sent.items():
            conns[addr].send_packed_command(self._packed(conns[addr], addr, todo))
        return sent

    def _receive(self, sent: dict[tuple[str, int], list[tuple[int, int]]]) -> dict[int, list[Any]]:
        """The replies of a :meth:`_send`, every one read before an error is raised (a
        MOVED/ASK, the slot moved in a failover, is transient: the retrier drops every
        connection and the slots are looked up again). A partition whose group Redis
        lost (restart, failover) gets it back where we are, and is read again."""
        spec = self.spec
        out: dict[int, list[Any]] = {}
        missing: dict[int, int] = {}
        failed: Exception | None = None
        for addr, todo in sent.items():
            conn = self.node_conns[addr]
            for p, n in todo:
                try:
                    r = conn.read_response(disconnect_on_error=False)
                except redis.exceptions.ResponseError as e:
                    if "NOGROUP" in str(e):
                        missing[p] = n
                    elif failed is None:
                        failed = e
                    continue
                out[p] = r[0][1] if r else []
        if failed is not None:
            raise failed
        if missing:
            ofs.seek_group(self._connect(), spec.dataset, spec.group, spec.generation,
                           {p: self.positions[p] for p in missing}, what="read")
            out.update(self._receive(self._send(missing)))
        return out

    def _fenced_read(self, counts: dict[int, int], *, ahead: bool) -> dict[int, list[Any]]:
        """XREADGROUP of each partition, pipelined on one connection per server (every
        server's commands written before any reply is read): one round trip.

        Fenced by eviction, not per read: the connections carry our generation in
        their name and checked their fences when opened (:meth:`_node`), and a newer
        trainer's restore closes every older one before it moves the group. A
        transaction per read (WATCH of the fences, then MULTI) would cost a round trip
        more, and on a cluster a connection per partition (a transaction may touch one
        slot only); a Lua script copies every reply into Lua values and back.

        With ``ahead``, the same read of the partitions that filled their count is sent
        again before returning, so the servers prepare it while this process builds
        batches; its entries wait in ``stash`` and are what the next reads return
        first. They are delivered to our consumer but not handed on: a reconnect
        moves the group back to ``positions`` and drops them, and a pass that stops
        early leaves them like the batches it read but did not yield (a session's
        next pass starts at what the loop consumed, before them)."""
        if self.inflight is not None:
            sent, self.inflight = self.inflight, None
            for p, entries in self._receive(sent).items():
                if entries:
                    self.stash[p] = entries
        out: dict[int, list[Any]] = {}
        need: dict[int, int] = {}
        for p, n in counts.items():
            held = self.stash.pop(p, None)
            if held:
                out[p] = held[:n]
                if len(held) > n:
                    self.stash[p] = held[n:]
            else:
                need[p] = n
        if need:
            out.update(self._receive(self._send(need)))
        if ahead:
            more = {p: n for p, n in counts.items() if len(out[p]) == n and p not in self.stash}
            if more:
                self.inflight = self._send(more)
        return out

    def read(self, counts: dict[int, int], *, ahead: bool = False
             ) -> dict[int, tuple[list[str], list[list[bytes]]]]:
        """Up to ``counts[p]`` new entries of each partition (possibly none), as their
        IDs and flat field lists, with the producer's end marks refreshed in the same
        round trip. ``ahead``: send the next read now (see :meth:`_fenced_read`)."""

        def call(c: redis.Redis) -> Any:
            got = self._fenced_read(counts, ahead=ahead)
            if self.spec.finite:
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
            limit = self.spec.epochs
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
        first ``spec.epochs`` epochs, the last entry of those once they are written."""
        if self.ends is not None:
            return
        prog = client.hgetall(streams.progress_key(self.spec.dataset))
        finished = prog.get(streams.PROGRESS_FINISHED) == b"1"
        limit = self.spec.epochs
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
                pipe.xrevrange(streams.partition_key(self.spec.dataset, p),
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
            streams.partition_key(self.spec.dataset, p): self.positions[p] for p in partitions
        }
        self._retry(lambda c: redis_client.wait_any(c, keys, self.spec.block_ms), reseek=True)

