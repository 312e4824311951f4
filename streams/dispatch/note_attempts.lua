-- A request kept claimed (its outcome unknown) failed again, and the copy carrying each of its sends on (for the
-- next attempt, or its dead letter) is acknowledged: note that attempt on the request's record as the send's live
-- one, so a copy for an earlier attempt (the lane message read again, a retry copy released again) that meets the
-- request later is stale, not a second chain of attempts. Never lowered; nothing when the record is gone.
-- KEYS[1] request record   ARGV[1] JSON {send id: live attempt}
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local noted = redis.call('HGET', KEYS[1], 'attempts')
local live = noted and cjson.decode(noted) or {}
for id, n in pairs(cjson.decode(ARGV[1])) do
  if not live[id] or live[id] < n then live[id] = n end
end
redis.call('HSET', KEYS[1], 'attempts', cjson.encode(live))
return 1
