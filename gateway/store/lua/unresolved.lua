-- The run that owns the key sent the request and lost the answer. ARGV: run_id,
-- reason, index member, channel. Returns 1 when the record is (now) unresolved for
-- this reason, 0 when another run or state holds it. The record stops expiring.
local state = redis.call('HGET', KEYS[1], 's')
if not state or redis.call('HGET', KEYS[1], 'r') ~= ARGV[1] then return 0 end
if state == 'unresolved' and redis.call('HGET', KEYS[1], 'why') == ARGV[2] then return 1 end
if state ~= 'in_flight' then return 0 end
local now = now_ms()
redis.call('HSET', KEYS[1], 's', 'unresolved', 'why', ARGV[2], 'u', now)
redis.call('HDEL', KEYS[1], 'l')
redis.call('PERSIST', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], now, ARGV[3])
add_event(KEYS[1], {at_ms = now, event = 'unknown', reason = ARGV[2]})
redis.call('SPUBLISH', ARGV[4], ARGV[3])
return 1
