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

PUSH_SLICE = """
local producer, seq = ARGV[1], tonumber(ARGV[2])
local start, total, count = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local mark = redis.call('HGET', KEYS[2], producer)
if mark then
  local m = tonumber(mark)
  if seq <= m then
    -- The last complete batch is known by its count and digest: another batch under
    -- its seq is refused (answered 'in already', its records would be lost in silence).
    local last = redis.call('HGET', KEYS[2], producer .. ':last')
    if last then
      local c = string.find(last, ':', 1, true)
      if tonumber(string.sub(last, 1, c - 1)) == seq
          and string.sub(last, c + 1) ~= ARGV[4] .. ':' .. ARGV[6] then
        return {-4, mark, string.sub(last, c + 1)}
      end
    end
    -- Rewritten as it is: a write, so the WAIT after this call also covers the
    -- batch's own earlier writes (a retry of a push that was not yet replicated).
    redis.call('HSET', KEYS[2], producer, mark)
    return {0, mark}
  end
  if seq ~= m + 1 then return {-1, mark} end
elseif seq ~= 0 then
  return {-1, ''}
end
local inflight = producer .. ':inflight'
local batch = ARGV[4] .. ':' .. ARGV[6]
local done = 0
local cur = redis.call('HGET', KEYS[2], inflight)
if cur then
  local c = string.find(cur, ':', 1, true)
  if tonumber(string.sub(cur, 1, c - 1)) == seq then
    local d = string.find(cur, ':', c + 1, true)
    if d then
      done = tonumber(string.sub(cur, c + 1, d - 1))
      -- Another batch under this seq: appending would merge the two, or (a smaller one)
      -- be answered as done with none of its records in.
      if string.sub(cur, d + 1) ~= batch then return {-3, tostring(done), string.sub(cur, d + 1)} end
    else
      done = tonumber(string.sub(cur, c + 1))  -- written before batches had digests
    end
  end
end
if start > done then return {-2, tostring(done)} end
local first, last, added = '', '', 0
local i = 7
for r = 0, count - 1 do
  local n = tonumber(ARGV[i])
  if start + r >= done then
    -- Raw records (kind, data) skip building a table: most of a push batch's time here.
    if n == 2 then
      last = redis.call('XADD', KEYS[1], '*', ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4])
    else
      local args = {'XADD', KEYS[1], '*'}
      for j = 1, 2 * n do args[#args + 1] = ARGV[i + j] end
      last = redis.call(unpack(args))
    end
    if first == '' then first = last end
    added = added + 1
  end
  i = i + 1 + 2 * n
end
local reached = math.max(done, start + count)
local acked = 0
if reached >= total then
  redis.call('HSET', KEYS[2], producer, ARGV[2], producer .. ':last', ARGV[2] .. ':' .. batch)
  redis.call('HDEL', KEYS[2], inflight)
  -- The partition's count of whole batches: the service remembers the highest it saw,
  -- and a Redis that comes back with less lost acknowledged batches.
  acked = redis.call('HINCRBY', KEYS[2], ':acked', 1)
else
  redis.call('HSET', KEYS[2], inflight, ARGV[2] .. ':' .. reached .. ':' .. batch)
end
return {1, first, last, added, acked}
"""
"""One slice of a push batch, exactly once per (producer, seq, index).

KEYS[1] stream, KEYS[2] the partition's seq hash: ``<producer>`` holds the mark (the
last seq wholly appended), ``<producer>:inflight`` holds
``<seq>:<records appended>:<record count>:<digest>`` of the batch under way (':' is
not allowed in a producer_id, so the fields never collide), ``<producer>:last`` holds
``<seq>:<record count>:<digest>`` of the last batch wholly appended (one per producer:
bounded). ARGV: producer_id, seq,
index of the slice's first record, the batch's record count, the slice's record
count, the batch's digest (hex, of its entries), then per record: field count n and n
field/value pairs.

Records whose index is below what the in-flight field says are already in the stream
and skipped, so a slice sent twice (a retry, or a second request for the same batch
running alongside) appends nothing twice; the mark rises when the last record is in.
The field ``:acked`` counts the partition's batches wholly appended. Returns {1,
first_id, last_id, appended, acked} (IDs '' when the slice appended nothing new; acked
0 unless this slice completed the batch);
{0, mark} when seq is at or below the mark (the batch is in); {-1, mark or ''} when
seq is not mark+1 (0 for a producer without a mark); {-2, reached} when the slice
starts past what is in (a slice skipped: resend the batch from its start); {-3,
reached, '<count>:<digest>'} when another batch (that count and digest) is partly in
under this seq: nothing appended; {-4, mark, '<count>:<digest>'} when seq is the
last complete batch's and this is another batch: nothing appended.
"""

PUSH_CONFIRM = """
local mark = redis.call('HGET', KEYS[1], ARGV[1])
if mark then redis.call('HSET', KEYS[1], ARGV[1], mark) end
return mark
"""
"""KEYS[1] a partition's seq hash, ARGV[1] a producer_id: rewrites the producer's mark
as it stands, atomically (never lowering one a concurrent batch raised). The write
makes a following ``WAIT`` cover every earlier write of that master, so a batch found
already in is acknowledged only once a replica has it."""

