-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Put a delivery that a run picked back where it was, unsent: the replicas did not
-- confirm the pick (store.wait_for_replicas), so a failover could lose it and the
-- attempt be made again. The attempt is not counted (queued again when none was
-- made before, else retrying), it is due again after delay_ms, and its history says
-- why in place of the pick's `attempt` event: unconfirmed picks in a row are one
-- `put_back` event, counted (`times`, `last_ms`), so a long wait for a replica does
-- not grow the history. ARGV: member, channel, run_id, delay_ms, reason, origin.
-- Returns {1, due} when put back (or by this same call before), else {0, 0}: nothing
-- changes.
local rec = redis.call('HMGET', R, 's', 'r', 'dl', 'n', 'due')
local state = rec[1]
if not state or rec[2] ~= ARGV[3] or rec[3] ~= '1' then return {0, 0} end
if PENDING[state] then return {1, tonumber(rec[5] or '0')} end
if state ~= 'in_flight' then return {0, 0} end
local now = now_ms()
local attempts = math.max(0, tonumber(rec[4] or '1') - 1)
local to = 'retrying'
if attempts == 0 then to = 'queued' end
local due = now + tonumber(ARGV[4])
local list = {}
local raw = redis.call('HGET', R, 'h')
if raw then list = history_of(raw) end
local last = list[#list]
if last and last.event == 'attempt' and last.run_id == ARGV[3] then table.remove(list) end
last = list[#list]
if last and last.event == 'put_back' and last.reason == ARGV[5] then
  last.times = (tonumber(last.times) or 1) + 1
  last.last_ms = now
else
  list[#list + 1] = {at_ms = now, event = 'put_back', reason = ARGV[5], times = 1}
end
redis.call('HSET', R, 'h', cjson.encode(list), 'n', attempts, 'due', due)
redis.call('HDEL', R, 'l')
move('in_flight', to, now, due)
announce(due, now, ARGV[6])
return {1, due}
