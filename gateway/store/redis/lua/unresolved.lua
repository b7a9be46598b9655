-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- The run that owns the key sent the request and lost the answer.
-- ARGV: member, channel, run_id, reason, target ('unresolved' or 'parked').
-- Returns 1 when the record is (now) open for this reason, 0 otherwise.
local state = redis.call('HGET', R, 's')
if not state or redis.call('HGET', R, 'r') ~= ARGV[3] then return 0 end
if state == ARGV[5] and redis.call('HGET', R, 'why') == ARGV[4] then return 1 end
if state ~= 'in_flight' then return 0 end
unknown('in_flight', ARGV[5], now_ms(), ARGV[4])
return 1
