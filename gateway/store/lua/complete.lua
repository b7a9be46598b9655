-- Store the response of the run that owns the key, in flight or unresolved (a late
-- answer is still the answer). ARGV: member, channel, run_id, response, ttl_ms, origin.
-- Returns 1 when the record is (now) completed by this run, else 0: nothing changes.
local state = redis.call('HGET', R, 's')
if not state or redis.call('HGET', R, 'r') ~= ARGV[3] then return 0 end
if state == 'completed' then return 1 end  -- our own completion, retried
if state ~= 'in_flight' and state ~= 'unresolved' then return 0 end
local now = now_ms()
if state == 'unresolved' or redis.call('HEXISTS', R, 'h') == 1 then
  add_event({at_ms = now, event = 'completed', origin = ARGV[6]})
end
redis.call('HSET', R, 'resp', ARGV[4])
redis.call('HDEL', R, 'why')
settle(state, 'completed', now, ARGV[5], function()
  return redis.call('HGET', R, 'f') .. '\n' .. ARGV[4]
end)
return 1
