-- Free the key of the run that owns it, in flight. ARGV: run_id, index member,
-- channel. Returns 1 when released (or already gone), 0 when someone else owns it.
local state = redis.call('HGET', KEYS[1], 's')
if not state then return 1 end
if state ~= 'in_flight' or redis.call('HGET', KEYS[1], 'r') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('SPUBLISH', ARGV[3], ARGV[2])
return 1
