"""Consumer-group positions, acknowledgements and fencing, as fenced Lua scripts.

Every operation that moves a run's consumer group (seek, acknowledge) runs as a Lua
script on the partition's own keys (stream, fence, seek: one hash slot), which first
compares the caller's fencing generation with the partition's fence (reads do the same
check optimistically, with WATCH and MULTI: see ``trainer_client.dataset``):

- fence > mine: a newer trainer of the run restored since; the script refuses with
  ``TGFENCED <current>`` and changes nothing (raised as :class:`FencedError`);
- fence < mine: Redis lost the fence (restart without persistence); re-assert it;
- equal: go on.

The generation is bumped by ``TrainingSession.restore``. A plain ``StreamingDataset``
without a session uses generation 0, which works as long as no session ever fenced the
group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import redis
import redis.exceptions

from trainer_client.errors import FencedError
from trainguard import streams

__all__ = [
    "ack_upto",
    "assert_generation",
    "bump_generation",
    "current_generations",
    "is_fenced_error",
    "seek_group",
    "start_pass",
    "write_seek",
]

_FENCE_CHECK = """
local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
local mine = tonumber(ARGV[2])
if cur > mine then return redis.error_reply('TGFENCED ' .. cur) end
if cur < mine then redis.call('SET', KEYS[2], ARGV[2]) end
"""

# Create-or-move the group to an ID; MKSTREAM because a partition may not exist yet
# (empty dataset, or Redis restarted without persistence and the producer is behind).
_SETID = """
local function setid(id)
  local r = redis.pcall('XGROUP', 'SETID', KEYS[1], ARGV[1], id)
  if type(r) == 'table' and r.err then
    redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], id, 'MKSTREAM')
  end
end
"""

# KEYS: stream, fence, seek.  ARGV: group, generation, ID, batches, write-seek (0/1).
SEEK_LUA = _FENCE_CHECK + _SETID + """
setid(ARGV[3])
if ARGV[5] == '1' then redis.call('HSET', KEYS[3], 'id', ARGV[3], 'batches', ARGV[4]) end
return 1
"""

# KEYS: stream, fence, seek.  ARGV: group, generation, ID, batches.
WRITE_SEEK_LUA = _FENCE_CHECK + """
redis.call('HSET', KEYS[3], 'id', ARGV[3], 'batches', ARGV[4])
return 1
"""

# Where a loader pass starts: the seek the trainer wrote (when ARGV[3] is '1'), else
# where the group stands (created at 0-0 when missing). Returns {id, batches}.
# KEYS: stream, fence, seek.  ARGV: group, generation, use-seek (0/1).
START_LUA = _FENCE_CHECK + _SETID + """
local id = false
if ARGV[3] == '1' then id = redis.call('HGET', KEYS[3], 'id') end
if id then
  setid(id)
  return {id, redis.call('HGET', KEYS[3], 'batches') or '0'}
end
local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
if type(groups) == 'table' and not groups.err then
  for _, g in ipairs(groups) do
    local name, last = nil, nil
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] end
      if g[i] == 'last-delivered-id' then last = g[i + 1] end
    end
    if name == ARGV[1] then return {last, '0'} end
  end
end
setid('0-0')
return {'0-0', '0'}
"""

# Acknowledge every pending entry of the group at or below an offset, whichever
# consumer holds it; returns the number acknowledged.
# KEYS: stream, fence.  ARGV: group, generation, offset.
ACK_LUA = _FENCE_CHECK + """
local acked = 0
while true do
  local pend = redis.pcall('XPENDING', KEYS[1], ARGV[1], '-', ARGV[3], 1000)
  if type(pend) ~= 'table' or pend.err or #pend == 0 then break end
  local ids = {}
  for i, e in ipairs(pend) do ids[i] = e[1] end
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
  if #pend < 1000 then break end
end
return acked
"""

# KEYS: fence.  ARGV: new generation. Returns the fence after the call.
BUMP_LUA = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local new = tonumber(ARGV[1])
if cur >= new then return cur end
redis.call('SET', KEYS[1], ARGV[1])
return new
"""

_scripts: dict[str, str] = {}


def _sha(source: str) -> str:
    sha = _scripts.get(source)
    if sha is None:
        import hashlib

        sha = hashlib.sha1(source.encode()).hexdigest()
        _scripts[source] = sha
    return sha


def eval_many(client: redis.Redis, source: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
    """Run one script once per (keys, args) in a single pipelined round trip.

    EVALSHA first; on NOSCRIPT (fresh or restarted Redis) load it and run again.
    Script errors come back as exception objects in the list, not raised.
    """
    if not calls:
        return []
    sha = _sha(source)
    for attempt in range(2):
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


def is_fenced_error(result: Any) -> int | None:
    """The newer generation if ``result`` is a script's fencing refusal, else None."""
    if isinstance(result, redis.exceptions.ResponseError) and str(result).startswith("TGFENCED"):
        return int(str(result).split()[1])
    return None


def _check(results: list[Any], *, group: str, mine: int, what: str) -> list[Any]:
    for r in results:
        current = is_fenced_error(r)
        if current is not None:
            raise FencedError(group=group, mine=mine, current=current, what=what)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def _pkeys(dataset: str, p: int, group: str) -> list[str]:
    return [
        streams.partition_key(dataset, p),
        streams.fence_key(dataset, p, group),
        streams.seek_key(dataset, p, group),
    ]


def _seek_calls(
    dataset: str,
    group: str,
    generation: int,
    positions: Mapping[int, str],
    batches: Mapping[int, int] | None,
    *more: str,
) -> list[tuple[list[str], list[Any]]]:
    """One (keys, args) pair per partition for the seek scripts, in partition order."""
    counts = batches or {}
    return [
        (_pkeys(dataset, p, group), [group, generation, i, counts.get(p, 0), *more])
        for p, i in sorted(positions.items())
    ]


def seek_group(
    client: redis.Redis,
    dataset: str,
    group: str,
    generation: int,
    positions: Mapping[int, str],
    *,
    batches: Mapping[int, int] | None = None,
    write: bool = False,
) -> None:
    """Move the group of each partition to its ID (XGROUP SETID, creating the group
    when missing); with ``write``, also record the seek for the next loader pass."""
    calls = _seek_calls(dataset, group, generation, positions, batches, "1" if write else "0")
    _check(eval_many(client, SEEK_LUA, calls), group=group, mine=generation, what="seek")


def write_seek(
    client: redis.Redis,
    dataset: str,
    group: str,
    generation: int,
    positions: Mapping[int, str],
    batches: Mapping[int, int] | None = None,
) -> None:
    calls = _seek_calls(dataset, group, generation, positions, batches)
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
    calls = [(_pkeys(dataset, p, group), [group, generation, "1" if use_seek else "0"]) for p in order]
    results = _check(eval_many(client, START_LUA, calls), group=group, mine=generation, what="read")
    out: dict[int, tuple[str, int]] = {}
    for p, (i, n) in zip(order, results):
        out[p] = (i.decode() if isinstance(i, bytes) else str(i), int(n))
    return out


def ack_upto(
    client: redis.Redis, dataset: str, group: str, generation: int, offsets: Mapping[int, str]
) -> int:
    """XACK every pending entry at or below each partition's offset; returns the count."""
    calls = [(_pkeys(dataset, p, group)[:2], [group, generation, i]) for p, i in sorted(offsets.items())]
    results = _check(eval_many(client, ACK_LUA, calls), group=group, mine=generation, what="acknowledge")
    return sum(int(r) for r in results)


def assert_generation(
    client: redis.Redis, dataset: str, group: str, generation: int, partitions: Iterable[int]
) -> None:
    """Raise FencedError if a partition's fence is above ``generation``; set fences
    that are below it (Redis lost them) back to it."""
    calls = [([streams.fence_key(dataset, p, group)], [generation]) for p in partitions]
    for r in eval_many(client, BUMP_LUA, calls):
        if isinstance(r, Exception):
            raise r
        if int(r) > generation:
            raise FencedError(group=group, mine=generation, current=int(r), what="read")


def current_generations(client: redis.Redis, dataset: str, group: str, partitions: int) -> list[int]:
    pipe = client.pipeline(transaction=False)
    for p in range(partitions):
        pipe.get(streams.fence_key(dataset, p, group))
    return [int(v) if v is not None else 0 for v in pipe.execute()]


def bump_generation(client: redis.Redis, dataset: str, group: str, partitions: int, floor: int) -> int:
    """Take a new fencing generation for the run: above every partition's fence and
    above ``floor`` (the generation of the checkpoint being restored)."""
    new = max([floor, *current_generations(client, dataset, group, partitions)]) + 1
    calls = [([streams.fence_key(dataset, p, group)], [new]) for p in range(partitions)]
    results = eval_many(client, BUMP_LUA, calls)
    for r in results:
        if isinstance(r, Exception):
            raise r
        if int(r) != new:
            raise FencedError(group=group, mine=new, current=int(r), what="restore")
    return new
