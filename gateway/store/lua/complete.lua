-- Store the response of the run that owns the key. ARGV: run_id, response, ttl_ms,
-- index member, channel, origin. Returns 1 when the record is (now) completed by
-- this run, 0 when another run or a person owns it: nothing is overwritten.
local state = redis.call('HGET', KEYS[1], 's')
if not state or redis.call('HGET', KEYS[1], 'r') ~= ARGV[1] then return 0 end
if state == 'completed' then return 1 end  -- our own completion, retried
if state ~= 'in_flight' and state ~= 'unresolved' then return 0 end
local now = now_ms()
if state == 'unresolved' then
  add_event(KEYS[1], {at_ms = now, event = 'completed', origin = ARGV[6]})
end
redis.call('HSET', KEYS[1], 's', 'completed', 'resp', ARGV[2], 'u', now)
redis.call('HDEL', KEYS[1], 'l', 'why')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[4])
redis.call('ZREM', KEYS[3], ARGV[4])
redis.call('SPUBLISH', ARGV[5], ARGV[4])
return 1
