-- A failed attempt's copy (its retry copy, fallback copy or dead letter) is acknowledged: mark each send
-- `tried:<n>` (n: the attempt that failed), so that a copy of it for attempt n or earlier, read again later,
-- is known stale. Unless the key says more already: a claim (a later attempt's, or a request kept claimed
-- after an unknown outcome), `delivered`, `reconcile`, or `tried:<m>` with m >= n.
-- KEYS: processed_jobs keys of one tenant   ARGV[1..#KEYS]: the attempts   ARGV[#KEYS + 1]: ttl (ms)
local ttl = ARGV[#KEYS + 1]
for i, key in ipairs(KEYS) do
  local n = tonumber(ARGV[i])
  local state = redis.call('GET', key)
  if not state or (string.sub(state, 1, 6) == 'tried:' and tonumber(string.sub(state, 7)) < n) then
    redis.call('SET', key, 'tried:' .. n, 'PX', ttl)
  end
end
return 1
