-- Give up a claim after a definite failure (the provider did not accept the request).
-- KEYS[1] lease   KEYS[2] request record   KEYS[3..] processed_jobs keys   ARGV[1] claim value
for i = 3, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
