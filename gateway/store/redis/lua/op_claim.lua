-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- An operator takes an open record. ARGV: member, channel, operator, force ('1'/'0').
-- Returns {1} | {0, 'held', holder, since_ms} | {0, 'state', state}.
local state = redis.call('HGET', R, 's')
if not state then return {0, 'state', 'missing'} end
if state ~= 'unresolved' and state ~= 'parked' and state ~= 'claimed' then
  return {0, 'state', state}
end
local now = now_ms()
local holder = redis.call('HGET', R, 'op')
if state == 'claimed' then
  if holder == ARGV[3] then return {1} end
  if ARGV[4] ~= '1' then return {0, 'held', holder, tonumber(redis.call('HGET', R, 'os'))} end
  add_event({at_ms = now, event = 'claimed', operator = ARGV[3], takeover_from = holder})
else
  add_event({at_ms = now, event = 'claimed', operator = ARGV[3]})
end
redis.call('HDEL', R, 'ck')
redis.call('HSET', R, 'op', ARGV[3], 'os', now)
move(state, 'claimed', now)
return {1}
