-- The outcome of a request is unknown: the provider may hold it. Mark its record so (no late
-- definite failure of another copy may release its sends), and drop the lease if this holder owns
-- it, so a later attempt takes the request over and re-sends it (a lease another worker took
-- meanwhile is left to it).
-- Its record gone (a failover lost the last writes; it expired): nothing can re-send its body, and a
-- send left free, or read `tried:<n>`, would go again in a new request under another key. Each send
-- that nothing settled or claimed anew is left to reconciliation instead: returns minus how many were.
-- KEYS[1] lease   KEYS[2] request record   KEYS[3..] its sends' processed_jobs keys
-- ARGV[1] owner   ARGV[2] `inflight:<key>`   ARGV[3] ttl of a reconcile mark (s)
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'unknown', '1')
else
  local marked = 0
  for i = 3, #KEYS do
    local state = redis.call('GET', KEYS[i])
    if not state or state == ARGV[2] or string.sub(state, 1, 6) == 'tried:' then
      redis.call('SET', KEYS[i], 'reconcile', 'EX', ARGV[3])
      marked = marked + 1
    end
  end
  if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
  return -marked
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
