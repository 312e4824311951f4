-- Reserve a place for a new endpoint of a tenant, within the most a tenant may have.
-- KEYS[1] the tenant's endpoints (hash)   KEYS[2] its places reserved by creates under way (sorted set, by deadline)
-- ARGV[1] the new endpoint's id   ARGV[2] how long the reservation holds (ms)   ARGV[3] the most
-- Endpoints plus creates under way are counted in one step, so concurrent creates cannot pass the bound.
-- A reservation whose create died before finishing lapses at its deadline. Time is Redis's own, so
-- hosts whose clocks differ agree on it. Returns 1 reserved, 0 full.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('HLEN', KEYS[1]) + redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[3]) then
  return 0
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[2], last[2])  -- the set goes with its last deadline
return 1
