-- Claim every send of one provider request, or none.
-- KEYS[1] lease   KEYS[2] request record (hash)   KEYS[3..#KEYS-1] processed_jobs key per send
-- KEYS[#KEYS] the epoch marker of this slot (read only when ARGV[11] is '1')
-- ARGV[1] claim value ("inflight:<idempotency key>")   ARGV[2] owner   ARGV[3] lease ms
-- ARGV[4] record ttl ms   ARGV[5] request path   ARGV[6] request body   ARGV[7] tenant   ARGV[8] send ids (JSON)
-- ARGV[9] provider name (empty: the channel's first). The record keeps the owner: only it releases.
-- ARGV[10] claim ttl ms: the sends stay claimed longer than the record lives, so a request whose outcome
-- stayed unknown past the provider's idempotency window is met as such (take_over.lua), never as free.
-- ARGV[11] '1': claim nothing when this slot has no epoch marker. The slot's data was lost (Redis
-- restarted empty, a shard failed over to an empty replica), so a delivered send would look free here.
-- ARGV[12] the attempt of each send above its first, JSON {send id: attempt} ('' when all are first attempts): a
-- copy of one of them for an earlier attempt, meeting this request later, is stale (see note_attempts.lua).
-- ARGV[13] the digest of the key the request goes under ('' : none): a recovered request is re-sent under it only.
-- ARGV[14] JSON list, one per processed_jobs key: the attempt this request makes of that send.
-- Returns {} when claimed, -1 when the marker is missing, else the 0-based positions of the sends that
-- are not free (free: no key, or `tried:<n>` below the attempt made now; `tried:<n>` at or above it landed
-- after the caller read the send: that attempt was made and failed, and the copy met now is stale).
local last = #KEYS - 1
if ARGV[11] == '1' and redis.call('EXISTS', KEYS[#KEYS]) == 0 then return -1 end
local busy = {}
local making = (ARGV[14] and ARGV[14] ~= '') and cjson.decode(ARGV[14]) or {}
for i = 3, last do
  local state = redis.call('GET', KEYS[i])
  -- `tried:<n>`: attempt n failed and its copy is acknowledged; the caller set aside copies for attempt n or earlier
  if state and (string.sub(state, 1, 6) ~= 'tried:'
                or tonumber(string.sub(state, 7)) >= (tonumber(making[i - 2]) or 1)) then
    busy[#busy + 1] = i - 3
  end
end
if #busy > 0 then return busy end
for i = 3, last do redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[10]) end
redis.call('DEL', KEYS[2])  -- a new claim starts a new record (never an older one's `unknown` mark)
redis.call('HSET', KEYS[2], 'path', ARGV[5], 'body', ARGV[6], 'tenant', ARGV[7], 'ids', ARGV[8], 'provider', ARGV[9],
           'owner', ARGV[2])
if ARGV[12] and ARGV[12] ~= '' then redis.call('HSET', KEYS[2], 'attempts', ARGV[12]) end
if ARGV[13] and ARGV[13] ~= '' then redis.call('HSET', KEYS[2], 'account', ARGV[13]) end
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {}
