"""Seeking a consumer group: the admin API's and the CLI's side of the fenced
group-move protocol (:mod:`trainguard.core.groups`).

A seek moves a group's last-delivered ID; the group then reads the entries *after*
that ID. It is refused when those entries may be missing: below the group's own
retention floor (the producer may trim up to the oldest floor, and a group that reads
below its own floor could have data trimmed under it once other groups move on) or
below what Redis already deleted or trimmed. Pending entries of the group stay
pending.

Each partition moves by the same fenced script a trainer's restore runs, under the
group's current fencing generation: a trainer that restores between this seek's
checks and its move (a higher generation) makes the move refused ("fenced") rather
than overwritten.

A seek moves the Redis side only. A ``TrainingSession`` treats its checkpoint
manifest as the truth: its ``restore`` moves the run's group to the manifest's
offsets, overriding any seek. So a seek matters to readers that do not restore from
a checkpoint; to rewind a TrainingSession run, restore or roll back to an older
checkpoint (and delete the newer ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from ingest_service import inspection
from ingest_service.errors import BadRequest, NotFound, Refused
from trainguard.core import groups, streams
from trainguard.core.streams import ContractError

__all__ = ["ACTIVE_IDLE_MS", "EARLIEST", "LATEST", "parse_seek_ids", "seek_group"]

EARLIEST, LATEST = "earliest", "latest"


def parse_seek_ids(raw: Any, partitions: int) -> dict[int, str]:
    """``{"3": "1-41", ...}`` -> ``{3: "1-41"}``, checked against the partition count."""
    if not isinstance(raw, Mapping) or not raw:
        raise BadRequest(
            "bad_ids", "ids must be a non-empty object {partition: stream ID}, e.g. "
            '{"0": "1-41"}'
        )
    out: dict[int, str] = {}
    for key, value in raw.items():
        text = str(key)
        if not text.isdigit() or not 0 <= int(text) < partitions:
            raise BadRequest(
                "bad_partition",
                f"partition {key!r} is not valid: expected an integer 0..{partitions - 1}",
            )
        if not isinstance(value, str):
            raise BadRequest("bad_id", f"stream ID {value!r} is not a string like '1-41'")
        try:
            parsed = streams.parse_id(value)
        except ContractError as exc:
            raise BadRequest("bad_id", str(exc)) from exc
        out[int(text)] = streams.format_id(parsed)
    return out


ACTIVE_IDLE_MS = 30_000
"""A consumer that read within this many milliseconds counts as running."""


async def _refuse_if_active(r: aioredis.Redis, dataset: str, group: str, parts: list[int]) -> None:
    pipe = r.pipeline(transaction=False)
    for p in parts:
        pipe.xinfo_consumers(streams.partition_key(dataset, p), group)
    active = sorted(
        {
            inspection.as_text(c["name"])
            for reply in await pipe.execute(raise_on_error=False)
            if not isinstance(reply, Exception)
            for c in reply
            if int(c["idle"]) < ACTIVE_IDLE_MS
        }
    )
    if active:
        raise Refused(
            "group_active",
            f"group {group!r} has consumers that read in the last {ACTIVE_IDLE_MS // 1000} s "
            f"({', '.join(active)}): a trainer is probably running and would skip or repeat "
            "records. Stop it first, or force the seek",
        )


async def seek_group(
    r: aioredis.Redis,
    dataset: str,
    group: str,
    *,
    to: str | None = None,
    ids: Mapping[int, str] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Move ``group`` to ``ids`` (a subset of partitions), or every partition to
    ``to`` = ``"earliest"`` (the lowest position whose following entries are all
    still present and protected) or ``"latest"`` (the stream's last ID).

    All targets are checked before any partition moves, so a refused seek changes
    nothing. The group must be registered on the dataset (``tg:{D}:groups``); it is
    created on partitions where it does not exist yet. Unless ``force``, a group with
    a consumer active in the last ``ACTIVE_IDLE_MS`` is refused: moving a running
    trainer's group under it makes it skip or repeat records.
    """
    spec = await inspection.dataset_spec(r, dataset)
    try:
        streams.check_name("group", group)
    except ContractError as exc:
        raise BadRequest("bad_name", str(exc)) from exc
    if (to is None) == (ids is None):
        raise BadRequest("bad_target", "give exactly one of 'to' (earliest|latest) or 'ids'")
    if to is not None and to not in (EARLIEST, LATEST):
        raise BadRequest("bad_target", f"'to' is {to!r}: expected 'earliest' or 'latest'")
    for p in ids or {}:
        if not 0 <= p < spec.partitions:
            raise BadRequest(
                "bad_partition",
                f"partition {p} is outside dataset {dataset!r} (0..{spec.partitions - 1})",
            )
    if group not in await inspection.group_names(r, dataset):
        raise NotFound(
            "group_not_found",
            f"group {group!r} is not registered on dataset {dataset!r}: expected one of "
            f"{await inspection.group_names(r, dataset)}; a trainer registers its run's group when it "
            "first reads",
        )
    parts = sorted(ids) if ids is not None else list(streams.all_partitions(spec))
    if not force:
        await _refuse_if_active(r, dataset, group, parts)
    floor = inspection.safe_offsets(await r.hgetall(streams.floor_key(dataset, group)))
    pipe = r.pipeline(transaction=False)
    for p in parts:
        pipe.xinfo_stream(streams.partition_key(dataset, p))
    infos = [inspection.stream_fields(x) for x in await pipe.execute(raise_on_error=False)]
    targets: dict[int, str] = {}
    for p, info in zip(parts, infos, strict=True):
        gone = streams.max_id(info["max_deleted_id"], info["removed_below"])
        lowest = streams.max_id(floor.get(p), gone) or streams.ZERO_ID
        if ids is not None:
            target = ids[p]
            if streams.parse_id(target) < streams.parse_id(lowest):
                why = (
                    "entries Redis already deleted or trimmed" if gone == lowest
                    else "its retention floor"
                )
                raise Refused(
                    "below_floor",
                    f"seek of group {group!r} partition {p} to {target} is below {why} "
                    f"({lowest}): the entries after {target} may be gone. Expected an ID "
                    f">= {lowest}; seek to 'earliest' for the lowest safe position",
                )
        elif to == EARLIEST:
            target = lowest
        else:
            target = info["last_generated_id"] or streams.ZERO_ID
        targets[p] = target
    await _move(r, dataset, group, targets)
    return {
        "dataset": dataset,
        "group": group,
        "offsets": streams.offsets_to_wire(targets),
    }


async def _move(r: aioredis.Redis, dataset: str, group: str, targets: Mapping[int, str]) -> None:
    """Move each partition's group to its target with the fenced seek script, under
    the newest fencing generation of the group's partitions; register the group."""
    pipe = r.pipeline(transaction=False)
    for p in targets:
        pipe.get(streams.fence_key(dataset, p, group))
    generation = max((int(g or 0) for g in await pipe.execute()), default=0)
    calls = groups.seek_calls(dataset, group, generation, targets, None, "0")
    sha = groups.script_sha(groups.SEEK_LUA)
    for attempt in range(2):
        pipe = r.pipeline(transaction=False)
        for keys, args in calls:
            pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
        replies = await pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(x, NoScriptError) for x in replies):
            await r.script_load(groups.SEEK_LUA)  # on every master of a cluster
            continue
        break
    for (p, target), reply in zip(targets.items(), replies, strict=True):
        newer = groups.fenced_generation(reply)
        if newer is not None:
            raise Refused(
                "fenced",
                f"seek of group {group!r} partition {p} to {target} was refused: a trainer "
                f"of the run restored (fencing generation {newer}) while the seek was "
                "being checked; look at the group again and retry",
            )
        if isinstance(reply, ResponseError):
            raise reply
    await r.sadd(streams.groups_key(dataset), group)
