-- The outcome of a request is unknown: the provider may hold it. Mark its record so (no late
-- definite failure of another copy may release its sends), and drop the lease if this holder owns
-- it, so a later attempt takes the request over and re-sends it (a lease another worker took
-- meanwhile is left to it).
-- KEYS[1] lease   KEYS[2] request record   ARGV[1] owner
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HSET', KEYS[2], 'unknown', '1') end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
