-- A send's status from an outcome event, compared and written in one step (two recorders, or a recorder and
-- `state recover`, applying two outcomes of one send at once must not write an earlier status over a final one).
-- KEYS[1] the send's status hash   ARGV[1] the event's status   ARGV[2] the hash's TTL (seconds)
-- ARGV[3] the event's attempts ('' when it says none)   ARGV[4..] field, value pairs to write
-- Written unless the current status is final and the event's is not, or the current status is delivered, or the
-- event is not final and says fewer attempts than recorded (a send's events are read from several partitions, in
-- any order: attempt 1's `retrying` arriving after attempt 2's `unknown` is behind it).
local current = redis.call('HGET', KEYS[1], 'status')
local final = {delivered = true, dead_lettered = true, dropped = true, skipped = true}  -- status.py FINAL
if current and final[current] and (not final[ARGV[1]] or current == 'delivered') then
  return 0
end
if current and not final[ARGV[1]] and ARGV[3] ~= '' then
  local recorded = tonumber(redis.call('HGET', KEYS[1], 'attempts') or '')
  if recorded and recorded > tonumber(ARGV[3]) then
    return 0
  end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
