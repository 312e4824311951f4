-- Give up a claim after a definite failure (the provider did not accept the request).
-- KEYS[1] lease   KEYS[2] request record   KEYS[3..] processed_jobs keys   ARGV[1] claim value   ARGV[2] owner
-- Only the lease's holder releases. Another holder took the request over (this one's lease had
-- lapsed) and its re-send may yet be accepted; no holder means the lease lapsed or a re-send's
-- outcome is unknown: either way the provider may hold the request, so the sends stay claimed
-- under its key (a later attempt re-sends that same request, answered from the provider's store).
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
for i = 3, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then redis.call('DEL', KEYS[i]) end
end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
