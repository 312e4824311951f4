-- Reserve a place for a new endpoint of a tenant, within the most a tenant may have.
-- KEYS[1] the tenant's endpoints (hash)   KEYS[2] its places reserved by creates under way (sorted set, by deadline)
-- ARGV[1] the new endpoint's id   ARGV[2] now (ms)   ARGV[3] the reservation's deadline (ms)   ARGV[4] the most
-- Endpoints plus creates under way are counted in one step, so concurrent creates cannot pass the bound.
-- A reservation whose create died before finishing lapses at its deadline. Returns 1 reserved, 0 full.
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
if redis.call('HLEN', KEYS[1]) + redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then
  return 0
end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('PEXPIREAT', KEYS[2], ARGV[3])
return 1
