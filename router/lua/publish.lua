-- Apply one replica's batch of KV events, in order, under its slot.
-- ARGV[1] prefix, ARGV[2] replica id, ARGV[3] slot (4 bytes), ARGV[4] ops: 9 bytes each, an op then the
-- 8-byte block key. Ops: '+' / '-' add / remove the block on the replica's device, 'H' / 'h' in its host
-- tier, 'D' / 'd' in its disk tier; a host-tier holder is written as the slot with its top bit set, a
-- disk-tier holder with the next bit (index_schema.py). The slot must be
-- the replica's registered or pending one, otherwise nothing is written and 0 is returned: the replica's
-- view is stale (e.g. Redis lost its data) and it must resync.
-- ARGV[5]: the batch's sequence number under the slot ('' for a resync's chunks). seq:<slot> holds the last
-- applied (switch.lua sets 0); a batch that does not follow it is not applied and {'gap', last} is returned,
-- so the replica replays what Redis lost (a restart from an older snapshot, a lagging replica promoted).
local p, id, slot, ops, seq = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5] or ''
if redis.call('HGET', p .. 'reg', id) ~= slot and redis.call('HGET', p .. 'pending', id) ~= slot then
  return 0
end
if seq ~= '' then
  local last = tonumber(redis.call('GET', p .. 'seq:' .. slot) or '-1')
  if last ~= tonumber(seq) - 1 then return {'gap', last} end
  redis.call('SET', p .. 'seq:' .. slot, seq)
end
local log = p .. 'log:' .. slot
local host = string.char(bit.bor(string.byte(slot, 1), 128)) .. string.sub(slot, 2)
local disk = string.char(bit.bor(string.byte(slot, 1), 64)) .. string.sub(slot, 2)
local tags = { ['H'] = host, ['h'] = host, ['D'] = disk, ['d'] = disk }
local added = {}
for i = 1, #ops, 9 do
  local op, key = string.sub(ops, i, i), string.sub(ops, i + 1, i + 8)
  local bucket, field = p .. 'b:' .. string.sub(key, 1, 2), string.sub(key, 3, 8)
  local tag = tags[op] or slot
  local value = redis.call('HGET', bucket, field) or ''
  local at = nil
  for j = 1, #value, 4 do
    if string.sub(value, j, j + 3) == tag then at = j break end
  end
  if op == '+' or op == 'H' or op == 'D' then
    if not at then
      redis.call('HSET', bucket, field, value .. tag)
      added[#added + 1] = key
    end
  elseif at then
    local rest = string.sub(value, 1, at - 1) .. string.sub(value, at + 4)
    if rest == '' then redis.call('HDEL', bucket, field) else redis.call('HSET', bucket, field, rest) end
  end
end
if #added > 0 then redis.call('APPEND', log, table.concat(added)) end
return 1
