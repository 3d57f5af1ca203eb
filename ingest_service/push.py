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
  seq until it is answered 200; it is completed, never duplicated.

Appending: the records go in slices (at most ``SLICE_RECORDS`` records and
``SLICE_BYTES`` bytes each), each one Lua call, so no Redis call runs long enough to
hold up other clients. Each slice is idempotent by ``(producer, seq, index)``: the
partition's seq hash remembers how many records of the batch under way are in, a
slice skips those, and the mark rises only with the batch's last record (see
:data:`ingest_service._lua.PUSH_SLICE`).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from ingest_service import _lua
from ingest_service._resp import call_packed_script, call_packed_scripts
from ingest_service.backlog import Backlog, BacklogLimits, min_committed, read_offsets
from ingest_service.errors import (
    BacklogFullError,
    MalformedPushError,
    PushOutOfOrderError,
    WrongDatasetKindError,
)
from trainguard.core import groups, streams

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

MAX_SEQ = 2**53 - 2
"""The largest seq of a batch (Lua compares seqs as doubles: exact up to 2^53)."""
PROBE_SEQ = MAX_SEQ + 1
"""Never appended: a push with this seq is answered 409 with the producer's mark, which
is how a (re)starting client learns where it stands."""
SLICE_RECORDS = 256
SLICE_BYTES = 512 * 1024


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


def parse_uint(name: str, text: str, maximum: int) -> int:
    """Strict: ASCII digits only, no sign or spaces, at most ``maximum``."""
    if not text or len(text) > 20 or not text.isascii() or not text.isdigit() \
            or int(text) > maximum:
        raise MalformedPushError(
            f"{name} {text[:40]!r} is not valid: expected an integer from 0 to {maximum}"
        )
    return int(text)


_PARAMS = frozenset({"producer_id", "seq"})


def parse_params(query: Mapping[str, str]) -> tuple[str, int]:
    """``producer_id`` and ``seq`` of a push request."""
    unknown = sorted(set(query) - _PARAMS)
    if unknown:
        raise MalformedPushError(
            f"unknown query parameters {unknown}: a push takes producer_id and seq (a "
            "producer's partition is fixed by its producer_id)"
        )
    producer_id = query.get("producer_id", "")
    try:
        streams.check_name("producer_id", producer_id)
    except streams.ContractError as exc:
        raise MalformedPushError(str(exc)) from exc
    seq = parse_uint("seq", query.get("seq", ""), PROBE_SEQ)
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
        self._slice_sha = groups.script_sha(_lua.PUSH_SLICE).encode()
        self._confirm_sha = groups.script_sha(_lua.PUSH_CONFIRM).encode()
        self._backlogs: dict[tuple[str, int], Backlog] = {}
        self._loading: dict[tuple[str, int], asyncio.Future[Backlog]] = {}

    async def _load(self, dataset: str, partition: int, after: streams.StreamId) -> Backlog:
        backlog = Backlog()
        await backlog.load(self.redis, streams.partition_key(dataset, partition), after)
        self._backlogs[(dataset, partition)] = backlog
        return backlog

    async def _backlog(self, dataset: str, partition: int) -> Backlog:
        committed = min_committed(await read_offsets(self.redis, dataset, "committed"), partition)
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

    async def check_order(self, spec: streams.DatasetSpec, producer_id: str, seq: int) -> int | None:
        """Before the body is read: the producer's mark when ``seq`` is at or below it
        (the batch is in: nothing to parse or append), None when ``seq`` is next; raises
        PushOutOfOrderError (409) otherwise. The Lua call decides again, atomically.

        A batch that is in is acknowledged only once a replica has it (as a batch
        appended now is): the retry of a push answered 503 for want of a replica finds
        its batch in on the master, and must not be told so before a replica holds it."""
        p = choose_partition(producer_id, spec.partitions)
        key = streams.seq_key(spec.name, p)
        raw = await self.redis.hget(key, producer_id)
        mark = None if raw is None else int(raw)
        if mark is not None and seq <= mark:
            if self.wait_replicas != 0:
                # Rewrites the mark as it stands (a write, so WAIT covers everything
                # this master did before it, the batch included).
                await call_packed_script(self.redis, _lua.PUSH_CONFIRM, self._confirm_sha,
                                         [key.encode()], [producer_id.encode()],
                                         replicas=self.wait_replicas, wait_ms=self.wait_ms)
            return mark
        if seq != (0 if mark is None else mark + 1):
            raise _out_of_order(seq, mark)
        return None

    async def check_room(self, spec: streams.DatasetSpec, producer_id: str, seq: int,
                         count: int = 0, size: int = 0) -> None:
        """Raises BacklogFullError (429) when the producer's partition has no room for
        ``count`` more records of ``size`` bytes, unless ``seq`` is already in (a retry
        is acknowledged whatever the backlog). With ``count`` 0 it runs before the body
        is read: a full partition refuses without parsing anything."""
        p = choose_partition(producer_id, spec.partitions)
        backlog = await self._backlog(spec.name, p)
        if count:
            full = not backlog.has_room(count, size, self.limits)
        else:
            full = backlog.entries > 0 and (backlog.entries >= self.limits.max_entries
                                            or backlog.bytes >= self.limits.max_bytes)
        if not full:
            return
        mark = await self.redis.hget(streams.seq_key(spec.name, p), producer_id)
        if mark is None or seq > int(mark):
            raise BacklogFullError(
                f"partition {p} of {spec.name!r} holds {backlog.entries} entries "
                f"({backlog.bytes} bytes) not yet committed by its consumers: the bound is "
                f"{self.limits.max_entries} entries / {self.limits.max_bytes} bytes; retry later",
                self.retry_after_s,
            )

    async def append(self, spec: streams.DatasetSpec, producer_id: str, seq: int,
                     records: list[dict[bytes, bytes]]) -> PushResult:
        check_push_dataset(spec)
        p = choose_partition(producer_id, spec.partitions)
        if seq == PROBE_SEQ:
            mark = await self.redis.hget(streams.seq_key(spec.name, p), producer_id)
            raise _out_of_order(seq, None if mark is None else int(mark))
        keys = [streams.partition_key(spec.name, p).encode(), streams.seq_key(spec.name, p).encode()]
        slices = _slices(records)
        calls: list[list[bytes]] = []
        for start, end in slices:
            args = [producer_id.encode(), b"%d" % seq, b"%d" % start, b"%d" % len(records),
                    b"%d" % (end - start)]
            for fields in records[start:end]:
                args.append(b"%d" % len(fields))
                for k, v in fields.items():
                    args += [k, v]
            calls.append(args)
        # All slices pipelined on one connection to the partition's master; acknowledged
        # only once a replica has them (when there is one): see NotReplicatedError.
        replies: Any = await call_packed_scripts(
            self.redis, _lua.PUSH_SLICE, self._slice_sha, keys, calls,
            replicas=self.wait_replicas, wait_ms=self.wait_ms,
        )
        return self._outcome(spec, p, seq, records, slices, replies)

    def _outcome(self, spec: streams.DatasetSpec, p: int, seq: int,
                 records: list[dict[bytes, bytes]], slices: list[tuple[int, int]],
                 replies: list[list[object]]) -> PushResult:
        status = int(replies[0][0])  # type: ignore[call-overload]
        if status == 0:
            return PushResult(p, seq, False, 0, None, None, int(_text(replies[0][1])))
        if status == -1:
            mark_text = _text(replies[0][1])
            raise _out_of_order(seq, int(mark_text) if mark_text else None)
        backlog = self._backlogs.get((spec.name, p))
        count, first, last = 0, None, None
        for (_, end), reply in zip(slices, replies, strict=True):
            if int(reply[0]) != 1:  # type: ignore[call-overload]
                continue  # a concurrent request for the same batch finished it
            a, b = _text(reply[1]), _text(reply[2])
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
        return PushResult(p, seq, count > 0, count, first, last, seq)


def _out_of_order(seq: int, mark: int | None) -> PushOutOfOrderError:
    expected = 0 if mark is None else mark + 1
    return PushOutOfOrderError(
        f"seq {seq} is out of order for this producer: its mark (last batch wholly appended) "
        f"is {mark if mark is not None else 'none'}, so the next batch is seq {expected}; "
        "resend from there (batches at or below the mark are in already)",
        mark,
    )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _slices(records: list[dict[bytes, bytes]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start = size = 0
    for i, fields in enumerate(records):
        n = streams.record_size(fields)
        if i > start and (i - start >= SLICE_RECORDS or size + n > SLICE_BYTES):
            out.append((start, i))
            start, size = i, 0
        size += n
    out.append((start, len(records)))
    return out
