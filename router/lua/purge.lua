-- Remove up to ARGV[4] of a slot's entries; call again until it returns 1.
-- ARGV[1] prefix, ARGV[2] replica id, ARGV[3] slot or '' (''= the dead replica's registered and pending
-- slots, refused with -1 while its heartbeat is alive), ARGV[4] chunk size.
-- The slot's log lists every key it ever added (removals are not logged); a cursor key makes the work
-- resumable by whoever calls next.
local p, id, slot, chunk = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local forget = false
if slot == '' then
  if redis.call('EXISTS', p .. 'hb:' .. id) == 1 then return -1 end
  slot = redis.call('HGET', p .. 'pending', id)
  if not slot then
    slot = redis.call('HGET', p .. 'reg', id)
    forget = true
  end
  if not slot then
    redis.call('HDEL', p .. 'ss', id) -- its conversation starts (session.lua) go with it
    return 1
  end
end
local log, cursor_key = p .. 'log:' .. slot, p .. 'purge:' .. slot
local host = string.char(bit.bor(string.byte(slot, 1), 128)) .. string.sub(slot, 2) -- its host-tier entries
local disk = string.char(bit.bor(string.byte(slot, 1), 64)) .. string.sub(slot, 2) -- and its disk tier's
local cursor = tonumber(redis.call('GET', cursor_key) or '0')
local data = redis.call('GETRANGE', log, cursor, cursor + chunk * 8 - 1)
for i = 1, #data, 8 do
  local bucket, field = p .. 'b:' .. string.sub(data, i, i + 1), string.sub(data, i + 2, i + 7)
  local value = redis.call('HGET', bucket, field)
  if value then
    local rest = {}
    for j = 1, #value, 4 do
      local holder = string.sub(value, j, j + 3)
      if holder ~= slot and holder ~= host and holder ~= disk then rest[#rest + 1] = holder end
    end
    rest = table.concat(rest)
    if rest == '' then redis.call('HDEL', bucket, field) elseif rest ~= value then redis.call('HSET', bucket, field, rest) end
  end
end
if #data < chunk * 8 then
  redis.call('DEL', log, cursor_key, p .. 'seq:' .. slot)
  if ARGV[3] == '' then
    if forget then redis.call('HDEL', p .. 'reg', id) else redis.call('HDEL', p .. 'pending', id) end
    return 0  -- this slot is done; the caller loops until nothing of <id> is left
  end
  return 1
end
redis.call('SET', cursor_key, cursor + #data)
return 0
