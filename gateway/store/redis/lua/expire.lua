-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- The sweep: an in_flight record whose lease has run out becomes open per policy.
-- ARGV: member, channel, policy. Returns the new state, or 0 if the lease holds.
local now = now_ms()
local state = redis.call('HGET', R, 's')
if not state then
  redis.call('ZREM', INDEX.in_flight, MEMBER)  -- index entry of a record now gone
  return 0
end
if state ~= 'in_flight' then return 0 end
if tonumber(redis.call('HGET', R, 'l')) > now then return 0 end
return expire_lease(now, ARGV[3])
