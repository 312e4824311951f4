-- Provider-wide cool-down: extend (never shorten) the moment until which nobody calls the provider.
-- KEYS[1] cool-down key   ARGV[1] milliseconds from now (Redis server time)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local untl = now + tonumber(ARGV[1])
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if untl > cur then
  redis.call('SET', KEYS[1], untl, 'PX', tonumber(ARGV[1]) + 1000)
  return untl
end
return cur
