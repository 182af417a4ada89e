-- A router started a new conversation on a replica: add one to that replica's decaying count of
-- conversation starts, shared by every router process (bounded-load placement, see KVAwarePolicy).
-- ARGV[1] prefix, ARGV[2] replica id, ARGV[3] decay time constant in seconds.
-- <prefix>ss HASH: id -> "<count> <seconds>": the count as of that Redis time; it decays as exp(-dt/tau),
-- so it tracks conversations started recently rather than forever (a replica added later is not flooded
-- until it catches up with the lifetime totals of the old ones).
if redis.replicate_commands then redis.replicate_commands() end -- Redis < 5: TIME before a write
local p, id, tau = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local count = 0
local v = redis.call('HGET', p .. 'ss', id)
if v then
  local c, at = string.match(v, '(%S+) (%S+)')
  count = tonumber(c) * math.exp(-math.max(now - tonumber(at), 0) / tau)
end
redis.call('HSET', p .. 'ss', id, string.format('%.6f %.6f', count + 1, now))
return 1
