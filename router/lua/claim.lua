-- Start a (re)synchronisation: allocate a fresh slot for <id> and record it as pending. The full cached
-- set is then published under it; switch.lua makes it live atomically. ARGV[1] prefix, ARGV[2] id.
local p, id = ARGV[1], ARGV[2]
local n = redis.call('INCR', p .. 'slots')
local slot = struct.pack('>I4', n)
redis.call('HSET', p .. 'pending', id, slot)
return slot
