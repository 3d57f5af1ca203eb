"""Lua scripts. Each touches only keys of one partition (one hash slot)."""

from __future__ import annotations

# Shared helpers: IDs are compared as (ms, seq) number pairs. Lua numbers are doubles,
# exact up to 2^53, far above our epochs and indexes.
_ID_HELPERS = """
local function parse(id)
  local d = string.find(id, '-', 1, true)
  return tonumber(string.sub(id, 1, d - 1)), tonumber(string.sub(id, d + 1))
end
local function less(a1, a2, b1, b2)
  return a1 < b1 or (a1 == b1 and a2 < b2)
end
local function last_id(key)
  local info = redis.call('XINFO', 'STREAM', key)
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then return info[i + 1] end
  end
  return '0-0'
end
"""

LAST_ID = _ID_HELPERS + """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
return last_id(KEYS[1])
"""
"""KEYS[1] stream -> its last generated ID (survives trimming), or nil if it is missing."""

APPEND = _ID_HELPERS + """
local l1, l2 = 0, 0
if redis.call('EXISTS', KEYS[1]) == 1 then
  l1, l2 = parse(last_id(KEYS[1]))
elseif ARGV[1] ~= '' then
  return {-1, 0, 0}
end
if ARGV[1] ~= '' then
  local e1, e2 = parse(ARGV[1])
  if less(l1, l2, e1, e2) then return {-2, l1, l2} end
end
local added, skipped = 0, 0
local i = 2
while i <= #ARGV do
  local id = ARGV[i]
  local n = tonumber(ARGV[i + 1])
  local a1, a2 = parse(id)
  if less(l1, l2, a1, a2) then
    local b = i + 1
    -- Fixed arities (the producer's entries have 3 or 5 fields) skip building a table.
    if n == 3 then
      redis.call('XADD', KEYS[1], id, ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4],
                 ARGV[b + 5], ARGV[b + 6])
    elseif n == 5 then
      redis.call('XADD', KEYS[1], id, ARGV[b + 1], ARGV[b + 2], ARGV[b + 3], ARGV[b + 4],
                 ARGV[b + 5], ARGV[b + 6], ARGV[b + 7], ARGV[b + 8], ARGV[b + 9], ARGV[b + 10])
    else
      local args = {'XADD', KEYS[1], id}
      for j = 1, 2 * n do args[#args + 1] = ARGV[b + j] end
      redis.call(unpack(args))
    end
    l1, l2 = a1, a2
    added = added + 1
  else
    skipped = skipped + 1
  end
  i = i + 2 + 2 * n
end
return {added, skipped, 0}
"""
"""Append entries with explicit IDs, exactly once.

KEYS[1] stream. ARGV[1]: the last ID the caller knows to be in the stream, or '' when
the stream may be created. Then per entry: ID, field count n, n field/value pairs.
Entries at or below the stream's last ID are already there and skipped. Returns
{added, skipped, 0}; {-1, 0, 0} when the stream is missing although the caller knows
entries in it (Redis lost it); {-2, ms, seq} when the stream ends before ARGV[1]
(Redis lost its tail), with the stream's last ID.
"""

PUSH = """
local raw = redis.call('HGET', KEYS[2], ARGV[1])
local seq = tonumber(ARGV[2])
if raw and seq <= tonumber(raw) then return {0, raw} end
local out = {1}
local i = 4
for r = 1, tonumber(ARGV[3]) do
  local n = tonumber(ARGV[i])
  local args = {'XADD', KEYS[1], '*'}
  for j = 1, 2 * n do args[#args + 1] = ARGV[i + j] end
  out[#out + 1] = redis.call(unpack(args))
  i = i + 1 + 2 * n
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return out
"""
"""Push append, exactly once per (producer, seq).

KEYS[1] stream, KEYS[2] the partition's seq hash. ARGV: producer_id, seq, record
count, then per record: field count n and n field/value pairs. Appends and raises the
mark only when seq is above the producer's mark: returns {1, id...}; else {0, mark}.
"""
