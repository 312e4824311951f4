-- Give up a claim after a definite failure (the provider did not accept the request).
-- KEYS[1] lease   KEYS[2] request record   KEYS[3..] processed_jobs keys   ARGV[1] claim value   ARGV[2] owner
-- ARGV[3] (optional) JSON list, one per processed_jobs key: the attempt before the one released, n (0: none).
-- The copy that made this attempt was read from the broker, so attempt n's carrier is durable: the key
-- becomes `tried:<n>` again (the claim had replaced it), not free, so that a copy of attempt n or earlier
-- met meanwhile stays stale.   ARGV[4] how long a `tried:<n>` mark lives (ms)
-- Nothing is released while another worker holds the lease (it took the request over: its re-send
-- may yet be accepted), nor once the request was re-sent or met an unknown outcome (its record is
-- marked `unknown`): the provider may hold a copy, so the sends stay claimed under the key and only
-- that same request is sent again. Nor is another worker's claim under the same key (the record
-- names its owner: a release asked again after a lost reply must not free a newer claim). A lease
-- that merely lapsed (its holder could not refresh it through a Redis outage) does not stop its
-- holder's release.
local holder = redis.call('GET', KEYS[1])
local owner = redis.call('HGET', KEYS[2], 'owner')
if (holder and holder ~= ARGV[2]) or (owner and owner ~= ARGV[2])
   or redis.call('HEXISTS', KEYS[2], 'unknown') == 1 then
  return 0
end
local earlier = (ARGV[3] and ARGV[3] ~= '') and cjson.decode(ARGV[3]) or nil
for i = 3, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    local n = earlier and tonumber(earlier[i - 2]) or 0
    if n > 0 then
      redis.call('SET', KEYS[i], 'tried:' .. n, 'PX', ARGV[4])
    else
      redis.call('DEL', KEYS[i])
    end
  end
end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
