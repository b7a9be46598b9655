-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- The operator holding a record decides. ARGV: member, channel, operator, outcome
-- ('done' | 'retry'), note, response, ttl_ms.
-- Returns {1, new_state} | {0, 'holder', holder} | {0, 'state', state}. A delivery's
-- 'retry' queues it again with every attempt to come; 'done' deletes its request.
local ttl = ms_arg(7)
local state = redis.call('HGET', R, 's')
if not state then return {0, 'state', 'missing'} end
if state ~= 'claimed' then return {0, 'state', state} end
local holder = redis.call('HGET', R, 'op')
if holder ~= ARGV[3] then return {0, 'holder', holder} end
local now = now_ms()
add_event({at_ms = now, event = 'resolved', operator = ARGV[3], outcome = ARGV[4], note = ARGV[5]})
if ARGV[4] == 'done' then
  redis.call('HSET', R, 'resp', ARGV[6])
  settle('claimed', 'completed', now, ttl)
  return {1, 'completed'}
end
if redis.call('HGET', R, 'dl') == '1' then
  redis.call('HSET', R, 'n', 0, 'due', now)
  redis.call('HDEL', R, 'why', 'op', 'os', 'ck')
  move('claimed', 'queued', now, now)
  announce(now, now, '')
  return {1, 'queued'}
end
settle('claimed', 'released', now, ttl)
return {1, 'released'}
