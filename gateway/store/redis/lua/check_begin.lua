-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Take the right to check an unresolved record with the upstream: one check at a
-- time per key across all replicas, and at most one per min_interval.
-- ARGV: member, channel, run_id, lock_ms, min_interval_ms, token. Returns 1 if
-- taken, or if this token already holds it (the same call, retried).
local state = redis.call('HGET', R, 's')
if state ~= 'unresolved' or redis.call('HGET', R, 'r') ~= ARGV[3] then return 0 end
local now = now_ms()
local lock = tonumber(redis.call('HGET', R, 'ck') or '0')
local last = tonumber(redis.call('HGET', R, 'lc') or '0')
if lock > now and redis.call('HGET', R, 'ckt') == ARGV[6] then return 1 end
if lock > now or now - last < tonumber(ARGV[5]) then return 0 end
redis.call('HSET', R, 'ck', now + tonumber(ARGV[4]), 'lc', now, 'ckt', ARGV[6])
return 1
