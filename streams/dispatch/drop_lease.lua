-- Drop a claim's lease (its outcome is unknown: a later attempt takes the request over and re-sends
-- it), only if this holder owns it: a lease another worker took meanwhile is left to it.
-- KEYS[1] lease   ARGV[1] owner
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
