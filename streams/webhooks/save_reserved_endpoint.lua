-- Write a new endpoint and give back the place reserved for it (reserve_endpoint.lua), in one step:
-- it is never counted twice, nor not at all.
-- KEYS[1] the tenant's endpoints (hash)   KEYS[2] its reserved places (sorted set)
-- ARGV[1] the endpoint's id   ARGV[2] the endpoint (JSON)
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
