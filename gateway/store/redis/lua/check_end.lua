-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Record a check's answer and act on it. ARGV: member, channel, run_id, result
-- ('done' | 'not_done' | 'inconclusive'), answer (JSON), response, ttl_ms,
-- park_after_ms, retry_ms (a delivery's next attempt after 'not_done'; '': none left).
-- Returns the record's state after it, or 0 if the run no longer holds it
-- unresolved (someone else settled it: nothing changes).
local ttl = ms_arg(7)
local state = redis.call('HGET', R, 's')
if state ~= 'unresolved' or redis.call('HGET', R, 'r') ~= ARGV[3] then return 0 end
local now = now_ms()
local answer = cjson.decode(ARGV[5])
redis.call('HDEL', R, 'ck')
redis.call('HSET', R, 'rc', ARGV[5])
add_event({at_ms = now, event = 'reconcile', result = ARGV[4], answer = answer})
if ARGV[4] == 'done' then
  redis.call('HSET', R, 'resp', ARGV[6])
  settle('unresolved', 'completed', now, ttl)
  return 'completed'
elseif ARGV[4] == 'not_done' and redis.call('HGET', R, 'dl') == '1' then
  local reason = 'the upstream says it did not run'
  if ARGV[9] == '' then
    reason = reason .. '; no attempt left'
    redis.call('HSET', R, 'why', reason)
    add_event({at_ms = now, event = 'parked', reason = reason})
    move('unresolved', 'parked', now)
    return 'parked'
  end
  local due = now + tonumber(ARGV[9])
  redis.call('HSET', R, 'due', due)
  redis.call('HDEL', R, 'why')
  add_event({at_ms = now, event = 'retry_scheduled', due_ms = due, reason = reason})
  move('unresolved', 'retrying', now, due)
  announce(due, now, '')
  return 'retrying'
elseif ARGV[4] == 'not_done' then
  add_event({at_ms = now, event = 'released', reason = 'the upstream says it did not run'})
  settle('unresolved', 'released', now, ttl)
  return 'released'
end
local since = tonumber(redis.call('HGET', R, 'u'))
if now - since >= tonumber(ARGV[8]) then
  add_event({at_ms = now, event = 'parked', reason = 'no conclusive check within park_after'})
  move('unresolved', 'parked', now)
  return 'parked'
end
return 'unresolved'
