-- `streams state recover`: a mark that keeps a copy read again from being sent (`reconcile`, `tried:<n>`), unless
-- the key says more already (`delivered`, `reconcile`, `tried:<m>` with m >= n) or holds a claim (`inflight:<key>`:
-- on a Redis Cluster shard that kept its data, a request to re-send byte for byte under its key).
-- KEYS[1] processed_jobs key   ARGV[1] `reconcile` or `tried:<n>`   ARGV[2] ttl (s). Returns 1 when written.
local state = redis.call('GET', KEYS[1])
if state == 'delivered' or state == 'reconcile' then return 0 end
if state and string.sub(state, 1, 9) == 'inflight:' then return 0 end
if state and string.sub(state, 1, 6) == 'tried:' and string.sub(ARGV[1], 1, 6) == 'tried:'
   and tonumber(string.sub(state, 7)) >= tonumber(string.sub(ARGV[1], 7)) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
