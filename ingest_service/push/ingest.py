"""Push ingestion: records arriving over HTTP, appended exactly once per (producer, seq).

The client's contract (what :class:`trainguard.push.Producer` does):

- A producer_id sends batches numbered ``seq`` = 0, 1, 2, ... with no gap; the next
  batch only after the previous one was answered 200. The mark (the last seq wholly
  appended) is per ``(dataset, producer_id)``.
- A producer's partition is fixed: ``crc32(producer_id) % partitions``. So its mark
  lives beside its records, in that partition's hash slot, and its records keep their
  seq order in the stream.
- ``seq`` <= mark: the batch is already in; answered 200 with ``appended: false``.
  ``seq`` = mark + 1 (0 without a mark): appended. Anything else is refused with 409
  and the mark, never acknowledged in silence: the client resends from ``mark + 1``.
- Every error other than 4xx (a 503 while Redis is down, a broken connection, a
  timeout) may leave the batch partly appended: resend the same batch with the same
  seq until it is answered 200; it is completed, never duplicated. Another batch
  under that seq is refused with 409 ``batch_mismatch``: a batch is known by its record
  count and digest (:class:`~ingest_service.push.body.BatchDigest`), kept in the
  in-flight marker, and for the last complete batch in ``<producer>:last``: a resend
  of the producer's last seq has its body read and compared (the same batch is 200
  ``appended: false``, another 409 ``batch_mismatch``); older seqs are answered in
  already unread (only the last one is kept, and the client resends only that one).
- A Redis that lost batches this service acknowledged is caught against its memory
  (:mod:`ingest_service.push.ledger`): the producer's next push is answered 409
  ``lost_acknowledged_data`` with the seqs lost, once.

Appending: the records go in slices (at most ``SLICE_RECORDS`` records and
``SLICE_BYTES`` bytes each), each one Lua call, so no Redis call runs long enough to
hold up other clients; the slices of a batch are packed here (payloads as they are)
and pipelined on one pooled connection. With the admission reads (the dataset's spec,
the producer's mark and the consumer groups in one pipeline; their commits in a second
when there are groups), a batch costs two or three round trips. Each slice is
idempotent by ``(producer, seq, index)``: the partition's seq hash remembers how many
records of the batch under way are in, a slice skips those, and the mark rises only
with the batch's last record (see :data:`ingest_service._lua.PUSH_SLICE`).
"""

from __future__ import annotations

import asyncio
import hashlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from redis.asyncio import Redis

from ingest_service import _lua
from ingest_service._resp import bulk, call_packed_script, call_packed_scripts, evalsha_head
from ingest_service.backlog import Backlog, BacklogLimits, min_committed
from ingest_service.datasets import spec_from_hash
from ingest_service.errors import (
    BacklogFullError,
    MalformedPushError,
    PushDataLostError,
    WrongDatasetKindError,
)
from ingest_service.push.body import BatchDigest
from ingest_service.push.ledger import ACKED_FIELD, AckLedger
from ingest_service.push.refusals import mismatch, out_of_order, text
from trainguard.core import groups, push_wire, streams

__all__ = [
    "MAX_SEQ",
    "PROBE_SEQ",
    "SLICE_BYTES",
    "SLICE_RECORDS",
    "PushIngest",
    "PushResult",
    "choose_partition",
    "parse_params",
    "parse_uint",
]

MAX_SEQ, PROBE_SEQ = push_wire.MAX_SEQ, push_wire.PROBE_SEQ
SLICE_RECORDS = 256
SLICE_BYTES = 512 * 1024
_SLICE_SHA = hashlib.sha1(_lua.PUSH_SLICE.encode()).hexdigest().encode()


@dataclass(frozen=True)
class PushResult:
    partition: int
    seq: int
    appended: bool
    """False: the batch was already in (a retry), this request appended nothing."""
    count: int
    """Records this request appended."""
    first_id: str | None
    last_id: str | None
    mark: int
    acked: int = 0
    """The partition's count of whole batches after this one (0: not known)."""


def parse_uint(name: str, text: str, maximum: int) -> int:
    """Strict: ASCII digits only, no sign or spaces, at most ``maximum``."""
    if not text or len(text) > 20 or not text.isascii() or not text.isdigit() \
            or int(text) > maximum:
        raise MalformedPushError(
            f"{name} {text[:40]!r} is not valid: expected an integer from 0 to {maximum}"
        )
    return int(text)




def parse_params(query: Mapping[str, str]) -> tuple[str, int]:
    """``producer_id`` and ``seq`` of a push request."""
    unknown = sorted(set(query) - push_wire.PARAMS)
    if unknown:
        raise MalformedPushError(
            f"unknown query parameters {unknown}: a push takes producer_id and seq (a "
            "producer's partition is fixed by its producer_id)"
        )
    producer_id = query.get(push_wire.PRODUCER_ID, "")
    try:
        streams.check_name(push_wire.PRODUCER_ID, producer_id)
    except streams.ContractError as exc:
        raise MalformedPushError(str(exc)) from exc
    seq = parse_uint(push_wire.SEQ, query.get(push_wire.SEQ, ""), PROBE_SEQ)
    return producer_id, seq


def choose_partition(producer_id: str, partitions: int) -> int:
    return zlib.crc32(producer_id.encode()) % partitions


def check_push_dataset(spec: streams.DatasetSpec) -> None:
    if spec.replayable:
        raise WrongDatasetKindError(
            f"dataset {spec.name!r} has format {spec.format!r}: push goes only to datasets "
            "of format 'push' (file datasets have deterministic IDs)"
        )


class PushIngest:
    """Appends push batches; keeps a backlog view per partition for the 429 decision.

    The backlog view is this process' (loaded from the stream once per partition after
    a start, however many requests wait for it, then kept up to date with its own
    appends and the consumers' commits). Its memory is a few numbers per slice.
    """

    def __init__(
        self, redis: Redis, limits: BacklogLimits, *, retry_after_s: int = 1,
        wait_replicas: int | None = None, wait_ms: int = 1000,
    ) -> None:
        self.redis = redis
        self.limits = limits
        self.retry_after_s = retry_after_s
        self.wait_replicas = wait_replicas
        self.wait_ms = wait_ms
        self.wait_aof = False
        """Wait for the local append-only file (``WAITAOF``) when no replica takes a
        push: set by :class:`~ingest_service.push.durability.DurabilityWatch`."""
        self.ledger = AckLedger()
        self._confirm_sha = groups.script_sha(_lua.PUSH_CONFIRM).encode()
        self._backlogs: dict[tuple[str, int], Backlog] = {}
        # The spec of each existing dataset last seen, beside the hash it was read from.
        self._specs: dict[str, tuple[dict[bytes, bytes], streams.DatasetSpec]] = {}
        self._loading: dict[tuple[str, int], asyncio.Future[Backlog]] = {}

    async def _load(self, dataset: str, partition: int, after: streams.StreamId) -> Backlog:
        backlog = Backlog()
        await backlog.load(self.redis, streams.partition_key(dataset, partition), after)
        self._backlogs[(dataset, partition)] = backlog
        return backlog

    async def _backlog(self, dataset: str, partition: int, committed: streams.StreamId
                       ) -> Backlog:
        key = (dataset, partition)
        backlog = self._backlogs.get(key)
        if backlog is None:
            # Single flight: the first request loads, the others wait for its result.
            loading = self._loading.get(key)
            if loading is None:
                loading = asyncio.ensure_future(self._load(dataset, partition, committed))
                self._loading[key] = loading
                loading.add_done_callback(lambda _: self._loading.pop(key, None))
            backlog = await asyncio.shield(loading)
        backlog.advance(committed)
        return backlog

    def forget(self, dataset: str) -> None:
        """Drop the backlog views of a dataset (deleted, or Redis lost it)."""
        for key in [k for k in self._backlogs if k[0] == dataset]:
            del self._backlogs[key]

    async def spec(self, name: str) -> streams.DatasetSpec | None:
        """The dataset's spec as last seen, else read (None: no such dataset)."""
        seen = self._specs.get(name)
        if seen is not None:
            return seen[1]
        raw = await self.redis.hgetall(streams.meta_key(name))
        return spec_from_hash(name, raw) if raw else None

    async def _check_ledger(self, name: str, p: int, producer_id: str, mark: int | None,
                            acked: object, read_at: int) -> None:
        """Against what this service acknowledged: raises PushDataLostError when the
        producer's mark went back (and drops the marker of the lost batch under way,
        so the producer can go on from its mark)."""
        self.ledger.check_partition(name, p, int(acked or 0),  # type: ignore[call-overload]
                                    read_at)
        try:
            self.ledger.check_mark(name, producer_id, mark, read_at)
        except PushDataLostError:
            await self.redis.hdel(streams.seq_key(name, p), f"{producer_id}:inflight")
            raise

    async def admit(self, name: str, producer_id: str, seq: int,
                    known: list[streams.DatasetSpec] | None = None
                    ) -> tuple[streams.DatasetSpec, int | None]:
        """Before the body is read: the dataset's spec, and the producer's mark when
        ``seq`` is at or below it (the batch is in: nothing to parse or append), None
        when ``seq`` is next and its partition has room, or is the last complete
        batch's (the body is compared with it). Raises DatasetNotFoundError
        (404), WrongDatasetKindError (409), PushOutOfOrderError (409) for any other
        seq, and BacklogFullError (429) when the partition's backlog is at its bound (a
        single batch over the bound still goes into an empty one). ``known`` receives the
        spec as soon as it is read, whatever the answer.

        The spec, the mark and the groups are read in one round trip: the mark of the
        partition the spec last seen says, read again if the spec read now says
        otherwise (the dataset was recreated). The Lua call decides the order again,
        atomically."""
        seen = self._specs.get(name)
        guess = None if seen is None else choose_partition(producer_id, seen[1].partitions)
        read_at = self.ledger.tick()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(streams.meta_key(name))
            pipe.smembers(streams.groups_key(name))
            if guess is not None:
                pipe.hmget(streams.seq_key(name, guess), _mark_fields(producer_id))
            raw_spec, raw_groups, *raw_mark = await pipe.execute()
        if not raw_spec:
            self._specs.pop(name, None)
            self.ledger.missing_dataset(name, read_at)
            self.ledger.check_mark(name, producer_id, None, read_at)
        if seen is not None and seen[0] == raw_spec:
            spec = seen[1]
        else:
            if seen is not None and raw_spec:
                # Recreated with another spec: on purpose, what it held is not a loss (a
                # Redis come back older has the spec it had).
                self.ledger.forget(name)
            spec = spec_from_hash(name, raw_spec)
            self._specs[name] = (raw_spec, spec)
        if known is not None:
            known.append(spec)
        check_push_dataset(spec)
        p = choose_partition(producer_id, spec.partitions)
        if p != guess:
            raw_mark = [await self.redis.hmget(streams.seq_key(name, p), _mark_fields(producer_id))]
        raw, acked, last = raw_mark[0]
        mark = None if raw is None else int(raw)
        await self._check_ledger(name, p, producer_id, mark, acked, read_at)
        if mark is not None and seq <= mark and not _is_last(seq, last):
            if self.wait_replicas != 0:
                # The batch is in, but it is acknowledged only once a replica has it (as
                # a batch appended now is): the retry of a push answered 503 for want of
                # a replica finds its batch in on the master. Rewriting the mark as it
                # stands is a write, so WAIT covers everything this master did before it.
                await call_packed_script(self.redis, _lua.PUSH_CONFIRM, self._confirm_sha,
                                         [streams.seq_key(name, p).encode()],
                                         [producer_id.encode()],
                                         replicas=self.wait_replicas, wait_ms=self.wait_ms,
                                         wait_aof=self.wait_aof)
            self.ledger.acknowledged(name, p, producer_id, mark, 0)
            return spec, mark
        if mark is not None and seq <= mark:
            # The last complete batch's seq: its body is read and its digest compared
            # by the append script (another batch is 409, the same one 200 in already).
            return spec, None
        if seq != (0 if mark is None else mark + 1):
            raise out_of_order(seq, mark)
        backlog = await self._backlog(name, p, await self._committed(name, p, raw_groups))
        if backlog.entries > 0 and (backlog.entries >= self.limits.max_entries
                                    or backlog.bytes >= self.limits.max_bytes):
            raise self._full(name, p, backlog)
        return spec, None

    async def _committed(self, dataset: str, partition: int, raw_groups: set[bytes]
                         ) -> streams.StreamId:
        """The smallest committed ID of ``partition`` over the groups named (0-0 when
        one committed nothing there; no groups: 0-0)."""
        if not raw_groups:
            return (0, 0)
        groups = sorted(g.decode() if isinstance(g, bytes) else str(g) for g in raw_groups)
        async with self.redis.pipeline(transaction=False) as pipe:
            for group in groups:
                pipe.hgetall(streams.committed_key(dataset, group))
            commits = await pipe.execute()
        return min_committed({g: streams.offsets_from_wire(c) for g, c in zip(groups, commits,
                                                                           strict=True)},
                             partition)

    async def check_room(self, spec: streams.DatasetSpec, producer_id: str, seq: int,
                         count: int, size: int) -> None:
        """After the body is parsed, with its real ``count`` and ``size``: raises
        BacklogFullError (429) when the producer's partition has no room for them
        (against the backlog view :meth:`admit` brought up to date), unless ``seq`` is
        in by now (a retry is acknowledged whatever the backlog)."""
        p = choose_partition(producer_id, spec.partitions)
        backlog = self._backlogs.get((spec.name, p))
        if backlog is None or backlog.has_room(count, size, self.limits):
            return
        mark = await self.redis.hget(streams.seq_key(spec.name, p), producer_id)
        if mark is None or seq > int(mark):
            raise self._full(spec.name, p, backlog)

    def _full(self, dataset: str, p: int, backlog: Backlog) -> BacklogFullError:
        return BacklogFullError(
            f"partition {p} of {dataset!r} holds {backlog.entries} entries "
            f"({backlog.bytes} bytes) not yet committed by its consumers: the bound is "
            f"{self.limits.max_entries} entries / {self.limits.max_bytes} bytes; retry later",
            self.retry_after_s,
        )

    async def append(self, spec: streams.DatasetSpec, producer_id: str, seq: int,
                     records: list[dict[bytes, bytes]], sizes: list[int] | None = None,
                     digest: str | None = None) -> PushResult:
        """Append a batch in slices (``sizes``: each record's entry size, ``digest``:
        its :class:`BatchDigest`, when known). Raises BatchMismatchError (409) when
        another batch is partly in under ``seq``."""
        check_push_dataset(spec)
        p = choose_partition(producer_id, spec.partitions)
        if seq == PROBE_SEQ:
            mark = await self.redis.hget(streams.seq_key(spec.name, p), producer_id)
            raise out_of_order(seq, None if mark is None else int(mark))
        keys = [streams.partition_key(spec.name, p).encode(), streams.seq_key(spec.name, p).encode()]
        if sizes is None:
            sizes = [streams.record_size(f) for f in records]
        slices = _slices(sizes)
        if digest is None:
            digest = BatchDigest.of(records)
        head = [producer_id.encode(), b"%d" % seq, b"", b"%d" % len(records), b"",
                digest.encode()]
        calls: list[list[bytes]] = []
        for start, end in slices:
            head[2], head[4] = b"%d" % start, b"%d" % (end - start)
            calls.append(_pack_slice(keys, head, records[start:end]))
            if len(slices) > 1:
                await asyncio.sleep(0)  # a slice packed: the loop's turn (a millisecond each)
        # All slices pipelined on one connection to the partition's master; acknowledged
        # only once a replica has them (when there is one): see NotReplicatedError.
        replies = await call_packed_scripts(self.redis, _lua.PUSH_SLICE, _SLICE_SHA, keys, calls,
                                            replicas=self.wait_replicas, wait_ms=self.wait_ms,
                                            wait_aof=self.wait_aof)
        result = self._outcome(spec, p, seq, records, slices, replies,  # type: ignore[arg-type]
                               digest)
        self.ledger.acknowledged(spec.name, p, producer_id, result.mark, result.acked)
        return result

    def _outcome(self, spec: streams.DatasetSpec, p: int, seq: int,
                 records: list[dict[bytes, bytes]], slices: list[tuple[int, int]],
                 replies: list[list[object]], digest: str) -> PushResult:
        status = int(replies[0][0])  # type: ignore[call-overload]
        if status == 0:
            return PushResult(p, seq, False, 0, None, None, int(text(replies[0][1])))
        if status == -1:
            mark_text = text(replies[0][1])
            raise out_of_order(seq, int(mark_text) if mark_text else None)
        if status in (-3, -4):
            raise mismatch(seq, len(records), digest, replies[0])
        backlog = self._backlogs.get((spec.name, p))
        count, first, last, acked = 0, None, None, 0
        for (_, end), reply in zip(slices, replies, strict=True):
            if int(reply[0]) != 1:  # type: ignore[call-overload]
                continue  # a concurrent request for the same batch finished it
            acked = max(acked, int(reply[4]))  # type: ignore[call-overload]
            a, b = text(reply[1]), text(reply[2])
            if not a:
                continue
            parsed_a, parsed_b = streams.parse_id(a), streams.parse_id(b)
            # Which of the slice's records this call appended: the last ones.
            added = int(reply[3])  # type: ignore[call-overload]
            size = sum(len(f.get(streams.F_DATA, b"")) for f in records[end - added:end])
            if backlog is not None:
                backlog.add(parsed_a, parsed_b, added, size)
            count += added
            first = first or a
            last = b
        return PushResult(p, seq, count > 0, count, first, last, seq, acked)


def _mark_fields(producer_id: str) -> list[str]:
    """The seq hash fields admit reads: the mark, the partition's count of whole
    batches and the last complete batch (``<seq>:<count>:<digest>``)."""
    return [producer_id, ACKED_FIELD, f"{producer_id}:last"]


def _is_last(seq: int, last: bytes | None) -> bool:
    return last is not None and last.split(b":", 1)[0] == b"%d" % seq


def _slices(sizes: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start = size = 0
    for i, n in enumerate(sizes):
        if i > start and (i - start >= SLICE_RECORDS or size + n > SLICE_BYTES):
            out.append((start, i))
            start, size = i, 0
        size += n
    out.append((start, len(sizes)))
    return out


_BIG = 512
"""Values from this many bytes on go to the socket as their own chunks, never copied."""
_COUNTS = [bulk(b"%d" % n) for n in range(16)]


def _pack_slice(keys: list[bytes], head: list[bytes], records: list[dict[bytes, bytes]]
                ) -> list[bytes]:
    """``EVALSHA`` of one slice as RESP chunks: ``head`` (producer, seq, start, total,
    count), then per record its field count and fields. Packed here, one format per
    record and payloads as they are: redis-py packs each argument apart in Python, which
    for a batch of 100 records cost 0.25 ms of CPU, this 0.07 ms."""
    argc = len(head) + sum(1 + 2 * len(f) for f in records)
    parts: list[bytes] = []
    # The small pieces gathered in a list and joined once per run of them: ``bytes +=``
    # copied the whole run at each piece, quadratic (a slice of 256 small records took
    # 6 ms, a batch of 10,000 a quarter of a second of the loop).
    pending = [evalsha_head(_SLICE_SHA, keys, argc), *(bulk(a) for a in head)]
    for fields in records:
        n = len(fields)
        pending.append(_COUNTS[n] if n < len(_COUNTS) else bulk(b"%d" % n))
        for k, v in fields.items():
            if len(v) < _BIG:
                pending.append(b"$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(k), k, len(v), v))
            else:
                pending.append(b"$%d\r\n%b\r\n$%d\r\n" % (len(k), k, len(v)))
                parts.append(b"".join(pending))
                parts.append(v)
                pending = [b"\r\n"]
    parts.append(b"".join(pending))
    return parts
