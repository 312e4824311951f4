-- Provider-wide cool-down: extend (never shorten) the moment until which nobody calls the provider.
-- KEYS[1] cool-down key   ARGV[1] milliseconds from now (Redis server time)
-- Extended when the hold left (the key's time to live, less the second it outlives the hold) ends sooner: its
-- stored moment may be one a clock stepped back since wrote, which says later than the hold lasts.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = tonumber(ARGV[1])
local untl = now + ms
if redis.call('PTTL', KEYS[1]) < ms + 1000 then
  redis.call('SET', KEYS[1], untl, 'PX', ms + 1000)
  return untl
end
return tonumber(redis.call('GET', KEYS[1]) or '0')
