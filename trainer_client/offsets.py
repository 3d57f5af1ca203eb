"""Consumer-group positions, acknowledgements and fencing: the trainer's side of the
fenced group-move protocol (:mod:`trainguard.core.groups`), run with a sync client.

Every operation that moves a run's consumer group (seek, acknowledge) runs a fenced
script on the partition's own keys. Reads are fenced by eviction instead: a reading
connection carries its generation in its name and checks the fences once, when opened;
a bump closes every reading connection of an older generation (see
``trainer_client._reader``). A refusal is raised as :class:`FencedError`. The
generation is bumped by ``TrainingSession.restore``: rank 0 takes it from the run's
counter (:func:`take_generation`, O(1)), each rank places its own partitions at it,
raising their fences in the same script (:func:`place_partitions`, O(P/W)), and once
every rank's fences hold it rank 0 closes the older readers (:func:`evict_readers`);
:func:`bump_generation` fences every partition in one process (:func:`fence_partitions`).
A plain ``StreamingDataset`` without a session uses generation 0, which works as long
as no session ever fenced the group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import redis
import redis.exceptions

from trainer_client import redis_client
from trainer_client.errors import EvictionRefusedError, FencedError
from trainguard.core import groups, streams
from trainguard.core.groups import (
    BUMP_LUA,
    FENCE_MANY_LUA,
    PLACE_MANY_LUA,
    SEEK_LUA,
    START_LUA,
    WRITE_SEEK_LUA,
)

__all__ = [
    "TAKE_TRIES",
    "ack_upto",
    "assert_generation",
    "bump_generation",
    "current_generations",
    "evict_readers",
    "fence_partitions",
    "partition_groups",
    "place_partitions",
    "reader_name",
    "seek_group",
    "settle_generation",
    "start_pass",
    "take_generation",
    "write_seek",
]

TAKE_TRIES = 3
"""Generations a restore takes before it gives up: a second is needed only when fences
above the counter exist (written by a trainguard without the counter, or the counter
was lost with a Redis restart), never twice in a row."""


def eval_many(
    client: redis.Redis, source: str, calls: list[groups.ScriptCall], *, replicated: bool = False
) -> list[Any]:
    """Run one script once per (keys, args) in a single pipelined round trip (one per
    master, all masters in turn, on a cluster).

    EVALSHA first; on NOSCRIPT (fresh or restarted Redis) load it and run again.
    Script errors come back as exception objects in the list, not raised. With
    ``replicated``, on a cluster, each master's pipeline ends with ``WAIT`` for one
    replica (up to ``REPLICA_WAIT_MS``): a fence a failover would lose is what lets a
    zombie trainer in.
    """
    if not calls:
        return []
    sha = groups.script_sha(source)
    for attempt in range(2):
        if redis_client.is_cluster(client):
            results = redis_client.eval_per_node(client, sha, calls, replicated=replicated)
        else:
            pipe = client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            results = pipe.execute(raise_on_error=False)
        if attempt == 0 and any(
            isinstance(r, redis.exceptions.NoScriptError) for r in results
        ):
            client.execute_command("SCRIPT", "LOAD", source)
            continue
        return results
    return results


def _check(results: list[Any], *, group: str, mine: int, what: str) -> list[Any]:
    refused = [g for g in map(groups.fenced_generation, results) if g is not None]
    if refused:  # the highest: a restore takes its next generation above it
        raise FencedError(group=group, mine=mine, current=max(refused), what=what)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def seek_group(
    client: redis.Redis,
    dataset: str,
    group: str,
    generation: int,
    positions: Mapping[int, str],
    *,
    batches: Mapping[int, int] | None = None,
    write: bool = False,
    what: str = "seek",
) -> None:
    """Move the group of each partition to its ID (XGROUP SETID, creating the group
    when missing); with ``write``, also record the seek for the next loader pass.
    ``what`` names the refused operation in a FencedError (a reader's own seek is a
    read)."""
    calls = groups.seek_calls(dataset, group, generation, positions, batches, "1" if write else "0")
    _check(eval_many(client, SEEK_LUA, calls), group=group, mine=generation, what=what)


def write_seek(
    client: redis.Redis,
    dataset: str,
    group: str,
    generation: int,
    positions: Mapping[int, str],
    batches: Mapping[int, int] | None = None,
) -> None:
    calls = groups.seek_calls(dataset, group, generation, positions, batches)
    _check(eval_many(client, WRITE_SEEK_LUA, calls), group=group, mine=generation, what="seek")


def start_pass(
    client: redis.Redis,
    dataset: str,
    group: str,
    generation: int,
    partitions: Iterable[int],
    *,
    use_seek: bool,
) -> dict[int, tuple[str, int]]:
    """Where a loader pass starts reading each partition: ``{p: (last ID, batches)}``,
    from the recorded seek (``use_seek``) or the group's position; the group is moved
    (or created) there."""
    order = list(partitions)
    calls = [(groups.partition_keys(dataset, p, group), [group, generation, "1" if use_seek else "0"]) for p in order]
    results = _check(eval_many(client, START_LUA, calls), group=group, mine=generation, what="read")
    out: dict[int, tuple[str, int]] = {}
    for p, (i, n) in zip(order, results):
        out[p] = (i.decode() if isinstance(i, bytes) else str(i), int(n))
    return out


def partition_groups(client: redis.Redis, dataset: str, partitions: Iterable[int]) -> list[list[int]]:
    """``partitions`` in groups that one many-partition script call may take: on one
    server, runs of at most ``MANY_PARTITIONS``; on a cluster, the same per hash slot
    (Redis refuses a script whose keys span slots; a partition's keys share its slot,
    and at 65,536 partitions over 16,384 slots a slot holds 4 on average, but the few
    partitions of one rank rarely share one: there it is a call per partition)."""
    order = sorted(partitions)
    if redis_client.is_cluster(client):
        cluster: Any = client
        by_slot: dict[int, list[int]] = {}
        for p in order:
            by_slot.setdefault(cluster.keyslot(streams.partition_key(dataset, p)), []).append(p)
        runs = list(by_slot.values())
    else:
        runs = [order] if order else []
    step = groups.MANY_PARTITIONS
    return [run[i:i + step] for run in runs for i in range(0, len(run), step)]


def _place(client: redis.Redis, dataset: str, group: str, generation: int,
           positions: Mapping[int, str], batches: Mapping[int, int] | None, mode: str,
           what: str) -> int:
    counts = batches or {}
    calls: list[groups.ScriptCall] = []
    for run in partition_groups(client, dataset, positions):
        keys = [k for p in run for k in groups.partition_keys(dataset, p, group)]
        args: list[Any] = [group, generation, mode]
        for p in run:
            args += [positions[p], counts.get(p, 0)]
        calls.append((keys, args))
    # A seek raises the fences (a restore's first move at its new generation): a
    # fence a failover would lose is what lets a zombie trainer in.
    results = _check(eval_many(client, PLACE_MANY_LUA, calls, replicated=mode == "seek"),
                     group=group, mine=generation, what=what)
    return sum(int(r) for r in results)


def ack_upto(
    client: redis.Redis, dataset: str, group: str, generation: int, offsets: Mapping[int, str]
) -> int:
    """XACK every pending entry at or below each partition's offset; returns the count.
    One script call per group of partitions (:func:`partition_groups`)."""
    return _place(client, dataset, group, generation, offsets, None, "ack", "acknowledge")


def place_partitions(
    client: redis.Redis, dataset: str, group: str, generation: int,
    positions: Mapping[int, str], batches: Mapping[int, int] | None = None,
) -> int:
    """A restore's placement of partitions: each fence raised to ``generation`` (never
    lowered), :func:`seek_group` (the seek recorded for the next loader pass) then
    :func:`ack_upto`, in one script call per group of partitions instead of three per
    partition; returns the entries acknowledged. A fence above ``generation`` refuses
    the call and leaves its partitions as they were (FencedError, ``current``: the
    highest fence found)."""
    return _place(client, dataset, group, generation, positions, batches, "seek", "seek")


def assert_generation(
    client: redis.Redis, dataset: str, group: str, generation: int, partitions: Iterable[int]
) -> None:
    """Raise FencedError if a partition's fence is above ``generation``; set fences
    that are below it (Redis lost them) back to it."""
    calls = [([streams.fence_key(dataset, p, group)], [generation]) for p in partitions]
    for r in eval_many(client, BUMP_LUA, calls, replicated=True):
        if isinstance(r, Exception):
            raise r
        if int(r) > generation:
            raise FencedError(group=group, mine=generation, current=int(r), what="read")


def current_generations(client: redis.Redis, dataset: str, group: str,
                        partitions: int | Iterable[int]) -> list[int]:
    """The fence of each partition (``partitions``: a count, all of them; or which)."""
    pipe = client.pipeline(transaction=False)
    for p in range(partitions) if isinstance(partitions, int) else partitions:
        pipe.get(streams.fence_key(dataset, p, group))
    return [int(v) if v is not None else 0 for v in pipe.execute()]


def take_generation(client: redis.Redis, dataset: str, group: str, floor: int) -> int:
    """A new fencing generation for the run, above its counter and ``floor`` (the
    generation of the checkpoint being restored): one script on one key, O(1)."""
    (r,) = eval_many(client, groups.GENERATION_LUA,
                     [([streams.generation_key(dataset, group)], [floor])], replicated=True)
    if isinstance(r, Exception):
        raise r
    return int(r)


def fence_partitions(client: redis.Redis, dataset: str, group: str, generation: int,
                     partitions: Iterable[int]) -> int:
    """Raise the fences of ``partitions`` to ``generation`` (never lower one); returns
    the highest fence found, ``generation`` when every one holds it now. One script
    call per group of partitions (:func:`partition_groups`)."""
    calls: list[groups.ScriptCall] = [
        ([streams.fence_key(dataset, p, group) for p in run], [generation])
        for run in partition_groups(client, dataset, partitions)]
    top = generation
    for r in eval_many(client, FENCE_MANY_LUA, calls, replicated=True):
        if isinstance(r, Exception):
            raise r
        top = max(top, int(r))
    return top


def settle_generation(client: redis.Redis, dataset: str, group: str, generation: int,
                      top: int) -> int:
    """After fencing at ``generation`` found a fence at ``top`` above it: the floor for
    the next generation to take, when the run's counter is still ``generation`` (that
    fence was written without the counter: by an older trainguard, or before Redis
    lost the counter); FencedError when the counter moved past it (a newer restore
    took over meanwhile: this trainer is the older one)."""
    current = int(client.get(streams.generation_key(dataset, group)) or 0)
    if current > generation:
        raise FencedError(group=group, mine=generation, current=current, what="restore")
    return top


def bump_generation(client: redis.Redis, dataset: str, group: str, partitions: int, floor: int) -> int:
    """Take a new fencing generation for the run, above every partition's fence and
    above ``floor``, fence every partition at it and close the older readers: a
    restore's fencing in one process (a session's ranks split it, each its own)."""
    for _ in range(TAKE_TRIES):
        new = take_generation(client, dataset, group, floor)
        top = fence_partitions(client, dataset, group, new, range(partitions))
        if top == new:
            evict_readers(client, dataset, group, new)
            return new
        floor = settle_generation(client, dataset, group, new, top)
    raise FencedError(group=group, mine=new, current=top, what="restore")


_READER = "trainguard-reader"
_NO_CLIENT = 2**63 - 1


def _reader_prefix(dataset: str, group: str) -> str:
    # Names cannot hold '|' (streams.check_name): another run's prefix never matches.
    return f"{_READER}|{dataset}|{group}|"


def reader_name(dataset: str, group: str, generation: int) -> str:
    """The client name of a reading connection (CLIENT SETNAME): what
    :func:`evict_readers` finds it by."""
    return f"{_reader_prefix(dataset, group)}{generation}"


def evict_readers(client: redis.Redis, dataset: str, group: str, generation: int) -> int:
    """Close every reading connection of ``group`` on ``dataset`` whose generation is
    below ``generation``, on every server (each node of a cluster, its slots looked up
    first); returns how many. Called once the fences hold ``generation``: a reader of
    an older generation then has no connection left, and any it opens checks the
    fences first and is refused. Redis runs no command of a client after CLIENT KILL
    returned, so nothing a zombie had pipelined moves the group afterwards.

    Needs ``CLIENT LIST`` and ``CLIENT KILL`` for the trainer's Redis user."""
    prefix = _reader_prefix(dataset, group)
    closed = 0
    for node in redis_client.servers(client):
        try:
            stale = [c["id"] for c in node.client_list(_type="normal")
                     if c.get("name", "").startswith(prefix)
                     and int(c["name"][len(prefix):]) < generation]
            pipe = node.pipeline(transaction=False)
            # The first kill matches no client (IDs count up from 1): it checks the
            # grant, so a missing one shows at the first restore, not at the one that
            # meets a zombie.
            for cid in [str(_NO_CLIENT), *stale]:
                pipe.client_kill_filter(_id=cid)
            closed += sum(int(n) for n in pipe.execute())
        except redis.exceptions.NoPermissionError as e:
            kw = node.get_connection_kwargs()
            raise EvictionRefusedError(node=f"{kw.get('host')}:{kw.get('port')}", group=group,
                                       refusal=str(e)) from e
    return closed
