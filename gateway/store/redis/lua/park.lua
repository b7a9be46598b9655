-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Hand an unresolved record to a person. ARGV: member, channel, reason.
local state = redis.call('HGET', R, 's')
if state ~= 'unresolved' then return 0 end
local now = now_ms()
add_event({at_ms = now, event = 'parked', reason = ARGV[3]})
redis.call('HDEL', R, 'ck')
move('unresolved', 'parked', now)
return 1
