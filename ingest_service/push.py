"""Push ingestion: records arriving over HTTP, appended exactly once per (producer, seq).

A push producer (e.g. an RL rollout worker) sends batches numbered by ``seq``, strictly
increasing per ``producer_id``. A batch goes to one partition (``crc32(producer_id) %
P`` unless the request names one) and is appended by one Lua call that also raises the
producer's mark in that partition's seq hash (same hash slot), only when ``seq`` is above
the mark: a network retry of an appended batch is acknowledged and not appended again.

Bodies: JSON Lines (one JSON value per line; ``application/x-ndjson``, the default) or
msgpack (``application/msgpack``: one array of records; ``bin`` items stay raw bytes).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
from redis.asyncio import Redis

from ingest_service import _lua
from ingest_service._resp import call_packed_script
from ingest_service.backlog import Backlog, BacklogLimits, min_committed, read_offsets
from ingest_service.errors import (
    BacklogFullError,
    MalformedPushError,
    PushTooLargeError,
    WrongDatasetKindError,
)
from trainguard.core import groups, streams

__all__ = ["MSGPACK_TYPES", "PushResult", "PushIngest", "parse_records", "parse_params", "choose_partition"]

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


@dataclass(frozen=True)
class PushResult:
    partition: int
    seq: int
    appended: bool
    """False: ``seq`` was at or below the producer's mark (a retry), nothing appended."""
    ids: list[str]
    mark: int


def parse_params(query: Mapping[str, str], partitions: int) -> tuple[str, int, int | None]:
    """``producer_id``, ``seq`` and the optional ``partition`` of a push request."""
    producer_id = query.get("producer_id", "")
    try:
        streams.check_name("producer_id", producer_id)
    except streams.ContractError as exc:
        raise MalformedPushError(str(exc)) from exc
    raw_seq = query.get("seq", "")
    if not raw_seq.isdigit() or int(raw_seq) >= 2**53:
        raise MalformedPushError(
            f"seq {raw_seq!r} is not valid: expected an integer from 0 to 2^53-1, increasing "
            "with every new batch of this producer_id"
        )
    raw_partition = query.get("partition")
    partition = None
    if raw_partition is not None:
        if not raw_partition.isdigit() or int(raw_partition) >= partitions:
            raise MalformedPushError(
                f"partition {raw_partition!r} is not valid: expected 0 to {partitions - 1}"
            )
        partition = int(raw_partition)
    return producer_id, int(raw_seq), partition


def choose_partition(producer_id: str, partitions: int) -> int:
    return zlib.crc32(producer_id.encode()) % partitions


def _encode(value: object, where: str, max_record_bytes: int) -> dict[bytes, bytes]:
    try:
        fields = streams.encode_record(value)
    except streams.ContractError as exc:
        raise MalformedPushError(f"{where}: {exc}") from exc
    size = streams.record_size(fields)
    if size > max_record_bytes:
        raise PushTooLargeError(f"{where} is {size} bytes: the limit is {max_record_bytes} per record")
    return fields


def parse_records(body: bytes, content_type: str, max_record_bytes: int) -> list[dict[bytes, bytes]]:
    """The records of a push body, encoded as stream entries. Raises MalformedPushError
    (400) or PushTooLargeError (413) naming the offending record."""
    records: list[dict[bytes, bytes]] = []
    if content_type in MSGPACK_TYPES:
        try:
            values = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise MalformedPushError(f"body is not valid msgpack: {exc}") from exc
        if not isinstance(values, list):
            raise MalformedPushError(
                f"msgpack body is a {type(values).__name__}: expected an array of records"
            )
        records = [_encode(v, f"record {i}", max_record_bytes) for i, v in enumerate(values)]
    else:
        for lineno, line in enumerate(body.split(b"\n"), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise MalformedPushError(f"line {lineno} is not valid JSON: {exc}") from exc
            records.append(_encode(value, f"line {lineno}", max_record_bytes))
    if not records:
        raise MalformedPushError("the body holds no record: expected at least one")
    return records


class PushIngest:
    """Appends push batches; keeps a backlog view per partition for the 429 decision.

    The backlog view is this process' (loaded from the stream on first use, then kept
    up to date with its own appends and the consumers' commits).
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
        self._sha = groups.script_sha(_lua.PUSH).encode()
        self._backlogs: dict[tuple[str, int], Backlog] = {}

    async def _backlog(self, dataset: str, partition: int) -> Backlog:
        committed = await read_offsets(self.redis, dataset, "committed")
        backlog = self._backlogs.get((dataset, partition))
        if backlog is None:
            backlog = Backlog()
            await backlog.load(
                self.redis, streams.partition_key(dataset, partition), min_committed(committed, partition)
            )
            self._backlogs[(dataset, partition)] = backlog
        backlog.advance(min_committed(committed, partition))
        return backlog

    async def append(
        self, spec: streams.DatasetSpec, producer_id: str, seq: int,
        records: list[dict[bytes, bytes]], partition: int | None = None,
    ) -> PushResult:
        if spec.replayable:
            raise WrongDatasetKindError(
                f"dataset {spec.name!r} has format {spec.format!r}: push goes only to datasets "
                "of format 'push' (file datasets have deterministic IDs)"
            )
        p = choose_partition(producer_id, spec.partitions) if partition is None else partition
        size = sum(len(f.get(streams.F_DATA, b"")) for f in records)  # payload bytes
        backlog = await self._backlog(spec.name, p)
        if not backlog.has_room(len(records), size, self.limits):
            mark = await self.redis.hget(streams.seq_key(spec.name, p), producer_id)
            if mark is None or seq > int(mark):
                raise BacklogFullError(
                    f"partition {p} of {spec.name!r} holds {backlog.entries} entries "
                    f"({backlog.bytes} bytes) not yet committed by its consumers: the bound is "
                    f"{self.limits.max_entries} entries / {self.limits.max_bytes} bytes; retry later",
                    self.retry_after_s,
                )
        args: list[bytes] = [producer_id.encode(), b"%d" % seq, b"%d" % len(records)]
        for fields in records:
            args.append(b"%d" % len(fields))
            for k, v in fields.items():
                args += [k, v]
        keys = [streams.partition_key(spec.name, p).encode(), streams.seq_key(spec.name, p).encode()]
        # Acknowledged only once a replica has it (when there is one): see NotReplicatedError.
        result: Any = await call_packed_script(
            self.redis, _lua.PUSH, self._sha, keys, args,
            replicas=self.wait_replicas, wait_ms=self.wait_ms,
        )
        if result[0] == 0:
            return PushResult(p, seq, False, [], int(result[1]))
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in result[1:]]
        parsed = [streams.parse_id(i) for i in ids]
        backlog.add(parsed[0], parsed[-1], len(parsed), size, parsed)
        return PushResult(p, seq, True, ids, seq)
