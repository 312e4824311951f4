-- Take over the request of a sender that is gone, to re-send it: take its lapsed lease, and mark
-- its record `unknown` (from now on the provider may hold a copy: no late definite failure of an
-- earlier copy may release its sends). Nothing when the lease is held. When the record is gone while
-- the sends met still carry its claim, it expired (after the provider's idempotency window): 0, the
-- request can no longer be re-sent safely, and its sends must not be sent afresh either. When they no
-- longer carry it, the request was settled meanwhile (delivered, or released): nil, read them again.
-- KEYS[1] lease   KEYS[2] request record   KEYS[3..] processed_jobs keys of the sends met
-- ARGV[1] owner   ARGV[2] lease ms   ARGV[3] claim value ("inflight:<idempotency key>")
-- Returns the record's fields and values, nil (held, or settled meanwhile), or 0 (gone).
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return nil end
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[1])
  for i = 3, #KEYS do
    if redis.call('GET', KEYS[i]) ~= ARGV[3] then return nil end
  end
  return 0
end
redis.call('HSET', KEYS[2], 'unknown', '1')
return redis.call('HGETALL', KEYS[2])
