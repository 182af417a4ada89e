-- For one chain of block keys and a list of candidate replicas, how many LEADING blocks each live
-- candidate holds, in one round trip.
-- ARGV[1] prefix, ARGV[2] chain (8 bytes per block: 2-byte bucket + 6-byte field), ARGV[3..] replica ids.
-- Predictions (p:<block key> -> replica id, short TTL, written by routers right after routing) are
-- checked at checkpoint depths 1, 2, 4, ... and the chain's end: a sibling of a request routed moments
-- ago counts as a hit on that replica before its KV events arrive, from any router process.
-- Returns { hits, missing, dead, starts, now }: hits = flat quadruples (candidate position, leading blocks
-- on its device, leading blocks on its device and host tier together, and with its disk tier too) for
-- candidates holding any;
-- missing = positions of candidates with no live heartbeat; dead = ids of those still registered (to
-- purge); starts = each candidate's "<count> <seconds>" of conversation starts (session.lua) or nil; now =
-- Redis' clock in seconds, as a string, to decay them against.
-- Live candidates in neither list hold 0 blocks. Sparse replies keep the client's parsing cost flat in
-- the number of candidates.
--
-- A replica's cached blocks of any chain are prefix-closed: a block is only ever cached after its
-- parent, only reachable through it, and eviction is LRU with every request's blocks freed tail-first, so
-- a parent always outlives its children. "Holds block i" is therefore monotone along the chain and each
-- candidate's count is found by galloping then binary search (~2 log2 n probes, shared between candidates
-- through a memo) instead of walking all n blocks. The host tier takes the blocks the device evicts, tail
-- first, and drops its oldest first, so device-then-host is prefix-closed too and is found the same way;
-- the disk tier takes what the host tier drops, LRU, and continues the chain past both the same way.
local p, chain = ARGV[1], ARGV[2]
local n = #chain / 8
local slots, live, missing, dead = {}, {}, {}, {}
local hb = {}
for i = 3, #ARGV do hb[#hb + 1] = p .. 'hb:' .. ARGV[i] end
local beats = #hb > 0 and redis.call('MGET', unpack(hb)) or {}
for k, slot in ipairs(beats) do
  if slot then
    slots[k] = slot
    live[#live + 1] = k
  else
    missing[#missing + 1] = k
    if redis.call('HEXISTS', p .. 'reg', ARGV[k + 2]) == 1 then dead[#dead + 1] = ARGV[k + 2] end
  end
end
local memo = {}
local function holders(i) -- replicas holding block i (1-based), as packed 4-byte slots
  local v = memo[i]
  if v == nil then
    local at = (i - 1) * 8 + 1
    v = redis.call('HGET', p .. 'b:' .. string.sub(chain, at, at + 1), string.sub(chain, at + 2, at + 7)) or ''
    memo[i] = v
  end
  return v
end
local function holds(i, slot)
  local v = holders(i)
  for j = 1, #v, 4 do
    if string.sub(v, j, j + 3) == slot then return true end
  end
  return false
end
local function depth(from, held) -- blocks 1..from held; gallop then bisect to the last held block
  local lo, hi, step = from, n + 1, 1 -- blocks 1..lo held; block hi not held (n + 1: past the end)
  while lo < n do
    local probe = math.min(lo + step, n)
    if held(probe) then
      lo = probe
      step = step * 2
    else
      hi = probe
      break
    end
  end
  while hi - lo > 1 and lo < n do
    local mid = math.floor((lo + hi) / 2)
    if held(mid) then lo = mid else hi = mid end
  end
  return lo
end
local counts, totals, disks = {}, {}, {}
for _, k in ipairs(live) do
  local slot = slots[k]
  local host = string.char(bit.bor(string.byte(slot, 1), 128)) .. string.sub(slot, 2)
  local disk = string.char(bit.bor(string.byte(slot, 1), 64)) .. string.sub(slot, 2)
  counts[k] = depth(0, function(i) return holds(i, slot) end)
  -- the host tier continues the chain where the device stops (a hash lives in one medium at a time)
  totals[k] = depth(counts[k], function(i) return holds(i, host) or holds(i, slot) end)
  disks[k] = depth(totals[k], function(i) return holds(i, disk) or holds(i, host) or holds(i, slot) end)
end
if #live > 0 and n > 0 then
  local position = {}
  for _, k in ipairs(live) do position[ARGV[k + 2]] = k end
  local depths, keys, d = {}, {}, 1
  while true do
    depths[#depths + 1] = d
    local at = (d - 1) * 8 + 1
    keys[#keys + 1] = p .. 'p:' .. string.sub(chain, at, at + 7)
    if d == n then break end
    d = math.min(d * 2, n)
  end
  local predicted = redis.call('MGET', unpack(keys))
  local known = 0 -- predictions only extend what the KV events already show somewhere: a prefix that some
  for _, k in ipairs(live) do -- replica really caches (a system prompt) must not pull traffic to the
    if counts[k] > known then known = counts[k] end -- latest router choice
  end
  for i, owner in ipairs(predicted) do
    local k = owner and position[owner]
    if k and depths[i] > known and depths[i] > counts[k] then counts[k] = depths[i] end
  end
end
local hits = {}
for _, k in ipairs(live) do
  if disks[k] > 0 or counts[k] > 0 then
    hits[#hits + 1] = k
    hits[#hits + 1] = counts[k]
    hits[#hits + 1] = math.max(totals[k], counts[k])
    hits[#hits + 1] = math.max(disks[k], totals[k], counts[k])
  end
end
local starts = #hb > 0 and redis.call('HMGET', p .. 'ss', unpack(ARGV, 3)) or {}
local t = redis.call('TIME')
return { hits, missing, dead, starts, t[1] .. '.' .. string.format('%06d', tonumber(t[2])) }
