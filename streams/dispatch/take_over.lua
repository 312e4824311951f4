-- Take over the request of a sender that is gone, to re-send it: take its lapsed lease, and mark
-- its record `unknown` (from now on the provider may hold a copy: no late definite failure of an
-- earlier copy may release its sends). Nothing when the lease is held. When the record is gone (it
-- expired, after the provider's idempotency window, while its sends stayed claimed), 0: the request
-- can no longer be re-sent safely, and its sends must not be sent afresh either.
-- KEYS[1] lease   KEYS[2] request record   ARGV[1] owner   ARGV[2] lease ms
-- Returns the record's fields and values, nil (held), or 0 (gone).
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return nil end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('HSET', KEYS[2], 'unknown', '1')
return redis.call('HGETALL', KEYS[2])
