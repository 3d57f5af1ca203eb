"""Seeking a consumer group: the admin API's and the CLI's side of the fenced
group-move protocol (:mod:`trainguard.core.groups`).

A seek moves a group's last-delivered ID; the group then reads the entries *after*
that ID. It is refused when those entries may be missing: below the group's own
retention floor (the producer may trim up to the oldest floor, and a group that reads
below its own floor could have data trimmed under it once other groups move on) or
below what Redis already deleted or trimmed. Pending entries of the group stay
pending.

Every target is checked first (a partition of the dataset, an ID of 64-bit parts, not
below what may be gone, not past the stream's last ID); then every partition moves in
one step: the same fenced script a trainer's restore runs, once per partition, all in
one MULTI/EXEC under WATCH of the fencing keys. A trainer that restores between this
seek's checks and its move (a higher generation) aborts the whole step ("fenced"),
and nothing moves.

On Redis Cluster no transaction spans partitions (each has its own slot): the checks
are the same and all run before anything moves, then each partition moves by the
same fenced script in its slot, pipelined per master, and partitions a failover
error left unmoved are sent again. A restore racing the move makes it "fenced" as on
one server, but partitions reached before the restore's new fence may have moved;
that restore then moves every partition to its checkpoint, so the group ends wholly
as the restore sets it, never as a mix (:func:`apply_per_slot` states the cases).

A seek moves the Redis side only. A ``TrainingSession`` treats its checkpoint
manifest as the truth: its ``restore`` moves the run's group to the manifest's
offsets, overriding any seek. So a seek matters to readers that do not restore from
a checkpoint; to rewind a TrainingSession run, restore or roll back to an older
checkpoint (and delete the newer ones).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError, WatchError

from ingest_service import inspection, redis_client
from ingest_service.errors import BadRequest, NotFound, Refused, Unavailable
from trainguard.core import groups, streams
from trainguard.core.resilience import Backoff, RetryPolicy
from trainguard.core.streams import ContractError

__all__ = ["ACTIVE_IDLE_MS", "EARLIEST", "LATEST", "check_seek_target", "parse_seek_ids", "seek_group"]

EARLIEST, LATEST = groups.SEEK_TARGETS


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
        if not text.isascii() or not text.isdigit() or len(text) > 5:
            raise BadRequest("bad_partition", f"partition {key!r} is not an integer")
        if int(text) >= partitions:
            raise NotFound(
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


def check_seek_target(to: object) -> groups.SeekTarget:
    """``to`` itself when it is one of :data:`~trainguard.core.groups.SEEK_TARGETS`; a
    request's or a config's value is a plain string (or worse), so the boundary checks."""
    if to not in groups.SEEK_TARGETS:
        raise BadRequest("bad_target", f"'to' is {to!r}: expected 'earliest' or 'latest'")
    return cast(groups.SeekTarget, to)


async def seek_group(
    r: aioredis.Redis,
    dataset: str,
    group: str,
    *,
    to: groups.SeekTarget | None = None,
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
    if to is not None:
        check_seek_target(to)
    for p in ids or {}:
        if not 0 <= p < spec.partitions:
            raise NotFound(
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
            end = info["last_generated_id"] or streams.ZERO_ID
            if streams.parse_id(target) > streams.parse_id(end):
                raise Refused(
                    "past_end",
                    f"seek of group {group!r} partition {p} to {target} is past the stream's "
                    f"last ID ({end}): expected an ID <= {end}; seek to 'latest' to skip all",
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
    """Move every partition's group to its target (see the module docstring), under
    the newest fencing generation of the group's partitions; then register the group."""
    if redis_client.is_cluster(r):
        await _move_per_slot(r, dataset, group, targets)
    else:
        await _move_atomic(r, dataset, group, targets)
    await r.sadd(streams.groups_key(dataset), group)


async def _move_atomic(r: aioredis.Redis, dataset: str, group: str,
                       targets: Mapping[int, str]) -> None:
    """One server: every partition in one MULTI/EXEC under WATCH of the fences."""
    fences = [streams.fence_key(dataset, p, group) for p in sorted(targets)]
    async with r.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(*fences)
            generation = max([int(await pipe.get(k) or 0) for k in fences], default=0)
            pipe.multi()
            for keys, args in groups.seek_calls(dataset, group, generation, targets, None, "0"):
                pipe.execute_command("EVAL", groups.SEEK_LUA, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        except WatchError as exc:
            raise Refused(
                "fenced",
                f"seek of group {group!r} was refused, nothing moved: a trainer of the run "
                "restored (a new fencing generation) while the seek was being checked; look "
                "at the group again and retry",
            ) from exc
    for (p, target), reply in zip(sorted(targets.items()), replies, strict=True):
        newer = groups.fenced_generation(reply)
        if newer is not None:  # not expected under WATCH; kept as the script's own guard
            raise Refused("fenced", f"seek of group {group!r} partition {p} to {target} was "
                          f"refused: fencing generation {newer} is newer")
        if isinstance(reply, ResponseError):
            raise reply


MOVE_POLICY = RetryPolicy(attempts=None, timeout_s=30.0, wait_initial_s=0.1, wait_max_s=1.0,
                          wait_jitter_s=0.1)
"""How long a cluster seek keeps retrying partitions a failover left unmoved."""


async def _move_per_slot(r: aioredis.Redis, dataset: str, group: str,
                         targets: Mapping[int, str]) -> None:
    """A cluster: each partition moves in its own slot (no transaction spans slots),
    all pipelined, one pipeline per master; what a failover error leaves unmoved is
    sent again (the move is idempotent: a position under a generation) until every
    partition moved or ``MOVE_POLICY`` runs out. See :func:`apply_per_slot`."""
    pipe = r.pipeline(transaction=False)
    for p in sorted(targets):
        pipe.get(streams.fence_key(dataset, p, group))
    generation = max((int(g or 0) for g in await pipe.execute()), default=0)
    await apply_per_slot(r, dataset, group, generation, targets)


async def apply_per_slot(r: aioredis.Redis, dataset: str, group: str, generation: int,
                         targets: Mapping[int, str]) -> None:
    """The cluster's apply step under ``generation`` (public for the test that races a
    restore against it). Ends in one of three ways:

    - every partition moved;
    - ``Refused("fenced")``: a trainer of the run took a newer generation meanwhile.
      Partitions it fenced first were not moved; others may have been. Only a
      ``TrainingSession`` restore takes a generation, and it moves *every* partition to
      its checkpoint's offsets under it, so once that restore is done no partition
      keeps this seek's position: the group is wholly the restore's;
    - ``Unavailable`` (503) when the cluster stayed unreachable past ``MOVE_POLICY``:
      the message names the partitions moved and not; the same seek again completes it.
    """
    calls = dict(zip(sorted(targets),
                     groups.seek_calls(dataset, group, generation, targets, None, "0"),
                     strict=True))
    sha = groups.script_sha(groups.SEEK_LUA)
    left = dict(calls)
    backoff = Backoff(MOVE_POLICY)
    deadline = time.monotonic() + (MOVE_POLICY.timeout_s or 0.0)
    fenced: dict[int, int] = {}
    last: BaseException | None = None
    while left:
        replies: list[Any]
        try:
            pipe = r.pipeline(transaction=False)
            for keys, args in left.values():
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        except redis_client.TRANSIENT as exc:
            replies, last = [exc] * len(left), exc
            await redis_client.refresh(r)
        if any(isinstance(x, NoScriptError) for x in replies):
            await r.script_load(groups.SEEK_LUA)  # on every master (a promoted one lacks it)
        for p, reply in zip(list(left), replies, strict=True):
            newer = groups.fenced_generation(reply)
            if newer is not None:
                fenced[p] = newer
                del left[p]
            elif isinstance(reply, Exception) and isinstance(
                    reply, (NoScriptError, *redis_client.TRANSIENT)):
                last = reply
            elif isinstance(reply, ResponseError):
                raise reply
            else:
                del left[p]
        if fenced:
            moved = sorted(set(targets) - set(left) - set(fenced))
            raise Refused(
                "fenced",
                f"seek of group {group!r} was refused: a trainer of the run restored "
                f"(fencing generation {max(fenced.values())}) during the move. Partitions "
                f"{sorted(fenced)} were fenced before this seek reached them; {moved} had "
                "moved, and that restore moves every partition to its checkpoint, so the "
                "group ends as the restore sets it. Look at the group again and retry",
            )
        if left:
            if time.monotonic() >= deadline:
                moved = sorted(set(targets) - set(left))
                raise Unavailable(
                    "seek_incomplete",
                    f"seek of group {group!r}: the cluster stayed unreachable for "
                    f"{MOVE_POLICY.timeout_s:.0f} s ({last}); partitions {moved} moved, "
                    f"{sorted(left)} did not. Send the same seek again to complete it",
                )
            await asyncio.sleep(backoff.next_wait_s())
