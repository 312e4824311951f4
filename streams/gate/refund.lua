-- Give back what an admission took and its caller did not use (an ingest request refused by another of its
-- quotas, a dispatch round's request the adapter refused or sent with fewer messages): both buckets are
-- refilled to now as gate.lua does, then credited, capped at their bursts.
-- KEYS as gate.lua (limits, global bucket, tenant bucket)   ARGV[1] tenant   ARGV[2] request cost
-- ARGV[3] message cost (the request cost is 0 for a request that went out with fewer messages).
-- Returns 1, or 0 when the limits are gone (nothing to give back to).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tenant = ARGV[1]
local l = redis.call('HMGET', KEYS[1], 'global_rate', 'global_burst',
  'tenant_rate:' .. tenant, 'tenant_burst:' .. tenant, 'tenant_rate:*', 'tenant_burst:*')
local g_rate, g_burst = tonumber(l[1]), tonumber(l[2])
local t_rate, t_burst = tonumber(l[3] or l[5]), tonumber(l[4] or l[6])
if not g_rate or not g_burst or not t_rate or not t_burst then return 0 end

local function credit(key, rate, burst, cost)
  local b = redis.call('HMGET', key, 'mt', 'ts')
  local full = burst * 1000
  if not b[1] or cost <= 0 then return end  -- expired: already full; or nothing to give back here
  local have = math.min(full, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rate)
  redis.call('HSET', key, 'mt', math.min(full, have + cost * 1000), 'ts', now)
  redis.call('PEXPIRE', key, math.min(math.ceil(burst * 1000 / rate), 1e15) + 60000)  -- as gate.lua
end

credit(KEYS[2], g_rate, g_burst, tonumber(ARGV[2]))
credit(KEYS[3], t_rate, t_burst, tonumber(ARGV[3]))
return 1
