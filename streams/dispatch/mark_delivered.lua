-- Mark every send of a provider request delivered; drop the request's lease and record.
-- KEYS[1] lease   KEYS[2] request record   KEYS[3..] processed_jobs keys   ARGV[1] ttl seconds
for i = 3, #KEYS do redis.call('SET', KEYS[i], 'delivered', 'EX', ARGV[1]) end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
