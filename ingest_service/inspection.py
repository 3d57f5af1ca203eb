"""Read operations on the Redis side of trainguard, shared by the admin API
and the ``trainguard`` CLI.

Everything here is a few pipelined Redis calls over the keys of
:mod:`trainguard.core.streams`; nothing is cached, so every answer is what Redis holds now.
Results are plain, JSON-ready dicts (stable field names, documented in
``ingest_service/service/openapi.py``).

Bytes per partition are Redis' ``MEMORY USAGE`` of the stream key with its default
sampling (5 entries per radix node), so they are an estimate of the key's RAM, not
the sum of the payloads.

Seeking is :mod:`ingest_service.seek`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import redis.asyncio as aioredis

from ingest_service.errors import BadRequest, NotFound, Refused
from trainguard.core import streams
from trainguard.core.streams import ContractError, DatasetNotFoundError, DatasetSpec

__all__ = [
    "BYTES_METHOD",
    "as_text",
    "dataset_groups",
    "dataset_spec",
    "group_names",
    "list_datasets",
    "safe_offsets",
    "show_dataset",
    "stream_fields",
]

BYTES_METHOD = "redis MEMORY USAGE (sampled estimate of the stream key's RAM)"


def as_text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def _check_dataset_name(dataset: str) -> None:
    try:
        streams.check_name("dataset", dataset)
    except ContractError as exc:
        raise BadRequest("bad_name", str(exc)) from exc


async def dataset_spec(r: aioredis.Redis, dataset: str) -> DatasetSpec:
    """The dataset's spec; NotFound when it is not registered."""
    _check_dataset_name(dataset)
    try:
        return DatasetSpec.of_meta(dataset, await r.hgetall(streams.meta_key(dataset)))
    except DatasetNotFoundError as exc:
        raise NotFound("dataset_not_found", str(exc)) from exc
    except (ContractError, ValueError, TypeError) as exc:
        raise Refused(
            "dataset_unreadable", f"metadata of dataset {dataset!r} cannot be read: {exc}"
        ) from exc


async def list_datasets(r: aioredis.Redis) -> list[dict[str, Any]]:
    """Every registered dataset with its spec and totals over its partitions."""
    names = sorted(as_text(n) for n in await r.smembers(streams.datasets_key()))
    out = []
    for name in names:
        try:
            info = await show_dataset(r, name)
        except NotFound:
            # Deleted between SMEMBERS and the read: it is gone, do not list it.
            continue
        except Refused as exc:
            out.append({"name": name, "error": {"code": exc.code, "message": str(exc)}})
            continue
        out.append(
            {
                "name": name,
                "spec": info["spec"],
                "partitions": len(info["partitions"]),
                "length": sum(p["length"] for p in info["partitions"]),
                "bytes": sum(p["bytes"] for p in info["partitions"]),
                "paused": sum(1 for p in info["partitions"] if p["paused"]),
                "dead_letters": info["dead_letters"],
                "groups": info["groups"],
            }
        )
    return out


def stream_fields(info: Any) -> dict[str, Any]:
    """Fields of one XINFO STREAM reply; a missing key reads as an empty stream."""
    if isinstance(info, Exception) or not info:
        return {
            "length": 0, "first_id": None, "last_id": None,
            "last_generated_id": None, "max_deleted_id": None, "removed_below": None,
        }
    first = info.get("first-entry")
    last = info.get("last-entry")
    deleted = as_text(info.get("max-deleted-entry-id"))
    length = int(info.get("length", 0))
    first_id = as_text(first[0]) if first else None
    last_generated = as_text(info.get("last-generated-id"))
    # XTRIM does not move max-deleted-entry-id, but it leaves entries-added above
    # length. Then every ID below the first entry may be gone: a reader is safe only
    # at or after the ID just below the first entry (or the last generated one when
    # the stream is empty).
    removed_below = None
    if int(info.get("entries-added", length)) > length:
        removed_below = _predecessor(first_id) if first_id else last_generated
    return {
        "length": length,
        "first_id": first_id,
        "last_id": as_text(last[0]) if last else None,
        "last_generated_id": last_generated,
        "max_deleted_id": None if deleted in (None, streams.ZERO_ID) else deleted,
        "removed_below": removed_below,
    }


_MAX_SEQ = 2**64 - 1


def _predecessor(stream_id: str) -> str:
    """The largest stream ID below ``stream_id`` (so nothing fits between them)."""
    ms, seq = streams.parse_id(stream_id)
    if seq > 0:
        return streams.format_id((ms, seq - 1))
    return streams.format_id((ms - 1, _MAX_SEQ)) if ms > 0 else streams.ZERO_ID


def _producer_position(spec: DatasetSpec, last_generated: str | None) -> dict[str, int] | None:
    """Where a replayable producer stands: epoch and records produced in that epoch."""
    if not spec.replayable or last_generated is None or last_generated == streams.ZERO_ID:
        return None
    try:
        epoch, index = streams.id_epoch_index(last_generated)
    except ContractError:
        return None
    return {"epoch": epoch, "records": index + 1}


async def _floors(r: aioredis.Redis, dataset: str, groups: list[str]) -> dict[str, dict[int, str]]:
    out: dict[str, dict[int, str]] = {}
    for group in groups:
        raw = await r.hgetall(streams.floor_key(dataset, group))
        try:
            out[group] = streams.offsets_from_wire(raw)
        except (ContractError, ValueError):
            out[group] = {}
    return out


async def group_names(r: aioredis.Redis, dataset: str) -> list[str]:
    return sorted(as_text(g) for g in await r.smembers(streams.groups_key(dataset)))


async def show_dataset(r: aioredis.Redis, dataset: str) -> dict[str, Any]:
    """One dataset: its spec and, per partition, length, first/last ID, bytes,
    producer position, paused flag and retention floor."""
    spec = await dataset_spec(r, dataset)
    parts = list(streams.all_partitions(spec))
    pipe = r.pipeline(transaction=False)
    for p in parts:
        pipe.xinfo_stream(streams.partition_key(dataset, p))
        pipe.memory_usage(streams.partition_key(dataset, p))
    pipe.smembers(streams.paused_key(dataset))
    pipe.xlen(streams.dlq_key(dataset))
    pipe.hgetall(streams.progress_key(dataset))
    replies = await pipe.execute(raise_on_error=False)
    paused_raw, dlq_len, progress = replies[-3], replies[-2], replies[-1]
    if isinstance(progress, Exception):
        progress = {}
    paused = set() if isinstance(paused_raw, Exception) else {str(as_text(m)) for m in paused_raw}
    groups = await group_names(r, dataset)
    floors = await _floors(r, dataset, groups)
    partitions = []
    for i, p in enumerate(parts):
        fields = stream_fields(replies[2 * i])
        mem = replies[2 * i + 1]
        floor = None
        for offsets in floors.values():
            floor = streams.min_id(floor, offsets.get(p))
        partitions.append(
            {
                "partition": p,
                **fields,
                "bytes": int(mem) if isinstance(mem, int) else 0,
                "producer_position": _producer_position(spec, fields["last_generated_id"]),
                "paused": str(p) in paused,
                "retention_floor": floor,
            }
        )
    return {
        "name": dataset,
        "spec": asdict(spec),
        "partitions": partitions,
        "bytes_method": BYTES_METHOD,
        "dead_letters": 0 if isinstance(dlq_len, Exception) else int(dlq_len),
        "producer": {
            "epochs_done": int(progress.get(streams.PROGRESS_EPOCHS_DONE, b"0") or 0),
            "finished": progress.get(streams.PROGRESS_FINISHED) == b"1",
        },
        "groups": groups,
    }


async def dataset_groups(r: aioredis.Redis, dataset: str) -> list[dict[str, Any]]:
    """Consumer groups of a dataset: per group and partition the last delivered ID,
    the committed offset (published by the trainer after a checkpoint commit), the
    lag (entries not yet delivered, as Redis counts it; null when Redis cannot tell
    after deletions), pending entries, and the consumers with their idle time."""
    spec = await dataset_spec(r, dataset)
    parts = list(streams.all_partitions(spec))
    pipe = r.pipeline(transaction=False)
    for p in parts:
        pipe.xinfo_groups(streams.partition_key(dataset, p))
    replies = await pipe.execute(raise_on_error=False)
    names = set(await group_names(r, dataset))
    by_partition: dict[int, dict[str, dict[str, Any]]] = {}
    for p, reply in zip(parts, replies, strict=True):
        rows = [] if isinstance(reply, Exception) else reply
        by_partition[p] = {as_text(g["name"]): g for g in rows}
        names.update(by_partition[p])
    out = []
    for group in sorted(names):
        committed_raw = await r.hgetall(streams.committed_key(dataset, group))
        floor_raw = await r.hgetall(streams.floor_key(dataset, group))
        committed = safe_offsets(committed_raw)
        floor = safe_offsets(floor_raw)
        pipe = r.pipeline(transaction=False)
        present = [p for p in parts if group in by_partition[p]]
        for p in present:
            pipe.xinfo_consumers(streams.partition_key(dataset, p), group)
        consumer_replies = dict(zip(present, await pipe.execute(raise_on_error=False),
                                    strict=True))
        rows = []
        for p in parts:
            info = by_partition[p].get(group)
            consumers = consumer_replies.get(p, [])
            if isinstance(consumers, Exception):
                consumers = []
            rows.append(
                {
                    "partition": p,
                    "exists": info is not None,
                    "last_delivered_id": as_text(info["last-delivered-id"]) if info else None,
                    "committed": committed.get(p),
                    "retention_floor": floor.get(p),
                    "lag": info.get("lag") if info else None,
                    "pending": int(info["pending"]) if info else 0,
                    "consumers": [
                        {"name": as_text(c["name"]), "pending": int(c["pending"]),
                         "idle_ms": int(c["idle"])}
                        for c in consumers
                    ],
                }
            )
        out.append({"group": group, "partitions": rows})
    return out


def safe_offsets(raw: Mapping[Any, Any]) -> dict[int, str]:
    try:
        return streams.offsets_from_wire(raw)
    except (ContractError, ValueError):
        return {}
