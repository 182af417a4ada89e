-- Heartbeat: refresh hb:<id> (whose value is the live slot) if <id> is still registered under that slot,
-- and store the replica's status report (JSON, for metrics and `kvmesh status`) with the same TTL.
-- ARGV[1] prefix, ARGV[2] id, ARGV[3] slot, ARGV[4] ttl ms, ARGV[5] status JSON or "".
-- Returns 1, or 0 when the replica must resync.
local p, id, slot = ARGV[1], ARGV[2], ARGV[3]
if redis.call('HGET', p .. 'reg', id) ~= slot then return 0 end
redis.call('SET', p .. 'hb:' .. id, slot, 'PX', ARGV[4])
if ARGV[5] ~= '' then redis.call('SET', p .. 'st:' .. id, ARGV[5], 'PX', ARGV[4]) end
return 1
