-- Settle every send of a provider request for good; drop the request's lease and record.
-- KEYS[1] lease   KEYS[2] request record   KEYS[3..] processed_jobs keys   ARGV[1] ttl seconds
-- ARGV[2] the final state: 'delivered', or 'reconcile' (outcome unknown at a provider without idempotency keys)
for i = 3, #KEYS do redis.call('SET', KEYS[i], ARGV[2], 'EX', ARGV[1]) end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
