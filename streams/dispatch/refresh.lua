-- Keep a claim's lease while its holder lives: extend it only if this holder still owns it.
-- KEYS[1] lease   ARGV[1] owner   ARGV[2] lease ms
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
