-- What other kvmesh router processes in front of the same workers just did (router/shared_routes.py).
-- ARGV: prefix, this router's id, the request's chain (8-byte block keys), then pairs (worker url, since):
-- returns {owners, routed}: owners[i] the worker a router last sent a request holding the prefix to depth
-- 1, 2, 4, ..., n (or false); routed[2k-1], routed[2k] the requests and prefill tokens other routers sent the
-- k-th worker after `since` (unix seconds: its last load report, which counts what came before).
local p, me, chain = ARGV[1], ARGV[2], ARGV[3]
local n = #chain / 8
local owners = {}
if n > 0 then
  local keys, d = {}, 1
  while true do
    keys[#keys + 1] = p .. 'p:' .. string.sub(chain, (d - 1) * 8 + 1, d * 8)
    if d == n then break end
    d = math.min(d * 2, n)
  end
  owners = redis.call('MGET', unpack(keys))
end
local routed = {}
for i = 4, #ARGV, 2 do
  local count, tokens = 0, 0
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', p .. 'r:' .. ARGV[i], '(' .. ARGV[i + 1], '+inf')) do
    local who, t = string.match(m, '^(%S+) %S+ (%d+)$')
    if who and who ~= me then
      count = count + 1
      tokens = tokens + tonumber(t)
    end
  end
  routed[#routed + 1] = count
  routed[#routed + 1] = tokens
end
return { owners, routed }
