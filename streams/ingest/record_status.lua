-- A send's status from an outcome event, compared and written in one step (two recorders, or a recorder and
-- `state recover`, applying two outcomes of one send at once must not write an earlier status over a final one).
-- KEYS[1] the send's status hash   ARGV[1] the event's status   ARGV[2] the hash's TTL (seconds)
-- ARGV[3..] field, value pairs to write
-- Written unless the current status is final and the event's is not, or the current status is delivered.
local current = redis.call('HGET', KEYS[1], 'status')
local final = {delivered = true, dead_lettered = true, dropped = true, skipped = true}  -- status.py FINAL
if current and final[current] and (not final[ARGV[1]] or current == 'delivered') then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
