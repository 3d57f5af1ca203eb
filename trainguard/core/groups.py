"""The fenced group-move protocol: how a run's consumer group is moved, acknowledged
and fenced, as Lua scripts on one partition's keys.

Both sides run these scripts, each with its own Redis client: the trainer
(``trainer_client.offsets``, sync) when it restores, seeks, reads and acknowledges,
and the admin API (``ingest_service.seek``, asyncio) when an operator seeks a group.
The scripts and their calls are defined here once; no client library is imported.

Every script first compares the caller's fencing generation with the partition's
fence (its keys share the partition's hash slot, so one script may touch them):

- fence > mine: a newer trainer of the run restored since; the script refuses with
  ``TGFENCED <current>`` and changes nothing (:func:`fenced_generation` reads it);
- fence < mine: Redis lost the fence (restart without persistence); re-assert it;
- equal: go on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal, get_args

from trainguard.core import streams

__all__ = [
    "ACK_LUA",
    "BUMP_LUA",
    "FENCE_MANY_LUA",
    "MANY_PARTITIONS",
    "PLACE_MANY_LUA",
    "GENERATION_LUA",
    "SEEK_LUA",
    "START_LUA",
    "WRITE_SEEK_LUA",
    "SEEK_TARGETS",
    "ScriptCall",
    "SeekTarget",
    "fenced_generation",
    "partition_keys",
    "script_sha",
    "seek_calls",
]

ScriptCall = tuple[list[str], list[Any]]
"""One script invocation: ``(KEYS, ARGV)``."""

SeekTarget = Literal["earliest", "latest"]
"""Where a group seek without IDs moves every partition: the lowest safe position, or
the stream's end. The admin API, its OpenAPI document and the CLI read this one type."""

SEEK_TARGETS: tuple[SeekTarget, ...] = get_args(SeekTarget)

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

# KEYS: the run's generation counter.  ARGV: floor. Returns the new generation: one
# above both, and the counter holds it (two restores never take the same one).
GENERATION_LUA = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if floor > cur then cur = floor end
redis.call('SET', KEYS[1], cur + 1)
return cur + 1
"""

# The same moves for many partitions in one script call: a restore's per-partition
# scripts cost the server its per-command overhead 2-3 times per partition (the
# queue of 16,384 ranks' restores on one server); one call per rank pays it once.
# On a cluster the keys of one call must share a slot (Redis checks the declared
# keys), so a call there holds the partitions of one slot.

MANY_PARTITIONS = 256
"""The most partitions of one many-partition script call: it bounds how long one call
holds the server (each partition's acknowledgements run inside it)."""

# KEYS: fences.  ARGV: new generation. Raises each fence below it (never lowers one);
# returns the highest fence found, the new generation when every one holds it now.
# One call a partition (SET ... GET): a restore fences every partition at a new
# generation, so the fence is below it but where another restore got further; that
# one is put back in the same script, so no client ever reads the lower value.
FENCE_MANY_LUA = """
local new = tonumber(ARGV[1])
local top = new
for i = 1, #KEYS do
  local old = redis.call('SET', KEYS[i], ARGV[1], 'GET')
  local cur = tonumber(old or '0')
  if cur > new then
    redis.call('SET', KEYS[i], old)
    if cur > top then top = cur end
  end
end
return top
"""

# SEEK_LUA (write-seek on) then ACK_LUA of each partition, or with mode 'ack' the
# ACK_LUA alone. Every fence is checked before anything moves, so a refusal changes
# nothing. With 'seek' (a restore's placement, at a generation just taken: every fence
# is below it) each fence is raised by one SET ... GET; a refusal puts back what it
# found. The restore needs no pass of fences of its own: the first script to move a
# partition at the new generation is the one that fences it, so no older trainer can
# move it after. Returns the number of entries acknowledged.
# KEYS: stream, fence, seek of each partition.
# ARGV: group, generation, mode ('seek' or 'ack'), then ID, batches of each partition.
PLACE_MANY_LUA = """
local group, mine, seek = ARGV[1], tonumber(ARGV[2]), ARGV[3] == 'seek'
local n = #KEYS / 3
local found, top = {}, mine
for i = 0, n - 1 do
  local old
  if seek then
    old = redis.call('SET', KEYS[3 * i + 2], ARGV[2], 'GET')
  else
    old = redis.call('GET', KEYS[3 * i + 2])
  end
  found[i] = old
  local cur = tonumber(old or '0')
  if cur > top then top = cur end
end
if top > mine then
  if seek then
    for i = 0, n - 1 do
      if found[i] then redis.call('SET', KEYS[3 * i + 2], found[i])
      else redis.call('DEL', KEYS[3 * i + 2]) end
    end
  end
  return redis.error_reply('TGFENCED ' .. top)
end
local acked = 0
for i = 0, n - 1 do
  local stream, fence, seek_key = KEYS[3 * i + 1], KEYS[3 * i + 2], KEYS[3 * i + 3]
  local id = ARGV[4 + 2 * i]
  if seek then
    local r = redis.pcall('XGROUP', 'SETID', stream, group, id)
    if type(r) == 'table' and r.err then
      redis.call('XGROUP', 'CREATE', stream, group, id, 'MKSTREAM')
    end
    redis.call('HSET', seek_key, 'id', id, 'batches', ARGV[5 + 2 * i])
  elseif tonumber(found[i] or '0') < mine then
    redis.call('SET', fence, ARGV[2])
  end
  while true do
    local pend = redis.pcall('XPENDING', stream, group, '-', id, 1000)
    if type(pend) ~= 'table' or pend.err or #pend == 0 then break end
    local ids = {}
    for j, e in ipairs(pend) do ids[j] = e[1] end
    acked = acked + redis.call('XACK', stream, group, unpack(ids))
    if #pend < 1000 then break end
  end
end
return acked
"""

_shas: dict[str, str] = {}


def script_sha(source: str) -> str:
    """The SHA1 that EVALSHA names ``source`` by (cached)."""
    sha = _shas.get(source)
    if sha is None:
        sha = _shas[source] = hashlib.sha1(source.encode()).hexdigest()
    return sha


def fenced_generation(result: Any) -> int | None:
    """The newer generation if ``result`` (an error reply) is a script's fencing
    refusal, else None."""
    if isinstance(result, Exception) and str(result).startswith("TGFENCED"):
        return int(str(result).split()[1])
    return None


def partition_keys(dataset: str, partition: int, group: str) -> list[str]:
    """KEYS of the seek and start scripts: stream, fence, seek (one hash slot)."""
    return [
        streams.partition_key(dataset, partition),
        streams.fence_key(dataset, partition, group),
        streams.seek_key(dataset, partition, group),
    ]


def seek_calls(
    dataset: str,
    group: str,
    generation: int,
    positions: Mapping[int, str],
    batches: Mapping[int, int] | None = None,
    *more: str,
) -> list[ScriptCall]:
    """One call per partition of :data:`SEEK_LUA` (``more`` = ``("1",)`` to record the
    seek too, ``("0",)`` not to) or :data:`WRITE_SEEK_LUA` (no ``more``), in
    partition order."""
    counts = batches or {}
    return [
        (partition_keys(dataset, p, group), [group, generation, i, counts.get(p, 0), *more])
        for p, i in sorted(positions.items())
    ]
