-- Give up a claim after a definite failure (the provider did not accept the request).
-- KEYS[1] lease   KEYS[2] request record   KEYS[3..] processed_jobs keys   ARGV[1] claim value   ARGV[2] owner
-- Nothing is released while another worker holds the lease: it took the request over (this one's
-- lease had lapsed) and its re-send, under the same key, may yet be accepted.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[2] then return 0 end
for i = 3, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
