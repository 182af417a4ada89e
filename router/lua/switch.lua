-- Make a fully published pending slot the replica's live one. ARGV[1] prefix, ARGV[2] id, ARGV[3] slot,
-- ARGV[4] ttl ms. Returns the previous live slot (to purge), '' if none, or false if the claim was lost.
local p, id, slot = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', p .. 'pending', id) ~= slot then return false end
local old = redis.call('HGET', p .. 'reg', id) or ''
redis.call('HSET', p .. 'reg', id, slot)
redis.call('HDEL', p .. 'pending', id)
redis.call('SET', p .. 'hb:' .. id, slot, 'PX', ARGV[4])
redis.call('SET', p .. 'seq:' .. slot, 0)  -- the live batches that follow are numbered from 1 (publish.lua)
return old
