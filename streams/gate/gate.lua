-- Two-level token-bucket gate: one round trip, Redis server time, millitokens (integers unless a rate is a
-- fraction: Redis keeps a fractional one to 17 digits, which reads back exactly).
-- Mirrors streams/gate/token_bucket.py (the reference; tests/integration/test_gate_matches_reference.py
-- runs one table of cases through both).
-- KEYS[1] limits hash   KEYS[2] global bucket   KEYS[3] tenant bucket   KEYS[4] cool-down until (ms)
-- ARGV[1] tenant   ARGV[2] request cost   ARGV[3] message cost   ARGV[4] "1" to apply the reserve
-- Returns {status, wait_ms, short}: status 1 admitted (both debited), 0 denied (no tokens written; a bucket
-- stamped after Redis's clock is stamped now), -1 a cost exceeds a burst (short = which bucket), -2 no provider
-- limit configured, -3 a rate not above 0 or a burst below 1, or not finite (short = which limit).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tenant = ARGV[1]
local req_cost = tonumber(ARGV[2])
local msg_cost = tonumber(ARGV[3])

local l = redis.call('HMGET', KEYS[1], 'global_rate', 'global_burst', 'reserve',
  'tenant_rate:' .. tenant, 'tenant_burst:' .. tenant, 'tenant_rate:*', 'tenant_burst:*')
local g_rate, g_burst = tonumber(l[1]), tonumber(l[2])
local t_rate, t_burst = tonumber(l[4] or l[6]), tonumber(l[5] or l[7])
if not g_rate or not g_burst or not t_rate or not t_burst then
  return {-2, 0, 'limits'}
end
-- A limit edited by hand past `streams limits set`: a rate of 0 would wait for ever, a negative one set a negative
-- expiry (the bucket deleted at each admission, found full at the next: no limit at all).
-- (Written as what must hold: NaN fails every comparison. Redis reads "inf" as a number too.)
local function usable(rate, burst)
  return rate > 0 and rate < math.huge and burst >= 1 and burst < math.huge
end
if not usable(g_rate, g_burst) then return {-3, 0, 'global'} end
if not usable(t_rate, t_burst) then return {-3, 0, 'tenant'} end
if req_cost > g_burst then return {-1, g_burst, 'global'} end
if msg_cost > t_burst then return {-1, t_burst, 'tenant'} end

local function refill(key, rate, burst)
  local b = redis.call('HMGET', key, 'mt', 'ts')
  local full = burst * 1000
  if not b[1] then return full end
  local ts = tonumber(b[2])
  if ts > now then
    -- Redis's clock stepped back since the last admission (a step, a failover to a server behind): the bucket
    -- refills from now, its tokens kept, or one left empty would stay empty until the clock is back at it.
    redis.call('HSET', key, 'ts', now)
    ts = now
  end
  return math.min(full, tonumber(b[1]) + (now - ts) * rate)
end

-- An idle bucket refills to full; expiring it then is the same as keeping it. (The cap guards only limits
-- stored before a refill was bounded to ten years: Redis reads larger figures as no integer.)
local function ttl(burst, rate)
  return math.min(math.ceil(burst * 1000 / rate), 1e15) + 60000
end

-- A denied bucket whose rate was lowered since its last admission may be set to expire before it could refill
-- at the new rate; it lives on until then, else it would come back full early. Only then is anything written:
-- at an unchanged rate the expiry set at the admission is always long enough.
local function keep(key, have, burst, rate)
  local need = math.min(math.ceil((burst * 1000 - have) / rate), 1e15) + 60000
  local left = redis.call('PTTL', key)
  if left >= 0 and left < need then redis.call('PEXPIRE', key, need) end
end

local function wait(have, need, rate)
  if have >= need then return 0 end
  return math.ceil((need - have) / rate)
end

local cool = tonumber(redis.call('GET', KEYS[4]) or '0')
if cool > now then return {0, cool - now, 'cooldown'} end

local g = refill(KEYS[2], g_rate, g_burst)
local tk = refill(KEYS[3], t_rate, t_burst)
local reserve = 0
if ARGV[4] == '1' then reserve = math.min(tonumber(l[3] or '0'), g_burst - req_cost) end
local g_wait = wait(g, (req_cost + reserve) * 1000, g_rate)
local t_wait = wait(tk, msg_cost * 1000, t_rate)
if g_wait > 0 or t_wait > 0 then
  keep(KEYS[2], g, g_burst, g_rate)  -- nothing is debited
  keep(KEYS[3], tk, t_burst, t_rate)
  if g_wait >= t_wait then return {0, g_wait, 'global'} end
  return {0, t_wait, 'tenant'}
end

redis.call('HSET', KEYS[2], 'mt', g - req_cost * 1000, 'ts', now)
redis.call('HSET', KEYS[3], 'mt', tk - msg_cost * 1000, 'ts', now)
redis.call('PEXPIRE', KEYS[2], ttl(g_burst, g_rate))
redis.call('PEXPIRE', KEYS[3], ttl(t_burst, t_rate))
return {1, 0, ''}
