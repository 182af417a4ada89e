-- Heartbeat: refresh hb:<id> (whose value is the live slot) if <id> is still registered under that slot.
-- ARGV[1] prefix, ARGV[2] id, ARGV[3] slot, ARGV[4] ttl ms. Returns 1, or 0 when the replica must resync.
local p, id, slot = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', p .. 'reg', id) ~= slot then return 0 end
redis.call('SET', p .. 'hb:' .. id, slot, 'PX', ARGV[4])
return 1
