-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Claim a free key for a run, or read what is there: one round trip.
-- ARGV: member, channel, run_id, fingerprint, lease_ms, route, key, expired-lease policy
-- Returns {1, now} when claimed, else {0, now, field, value, ...}.
local now = now_ms()
local state = redis.call('HGET', R, 's')
if state == 'in_flight' and tonumber(redis.call('HGET', R, 'l')) <= now then
  state = expire_lease(now, ARGV[8])
end
if not state or state == 'released' then
  local history = false
  if state then  -- a released tombstone: its story goes on in the new run
    history = redis.call('HGET', R, 'h')
    redis.call('DEL', R)
  end
  local lease = now + tonumber(ARGV[5])
  redis.call('HSET', R, 's', 'in_flight', 'r', ARGV[3], 'f', ARGV[4], 'l', lease,
    'c', now, 'u', now, 'rt', ARGV[6], 'k', ARGV[7])
  if history then redis.call('HSET', R, 'h', history) end
  redis.call('ZADD', INDEX.in_flight, lease, MEMBER)
  return {1, now}
end
if state == 'in_flight' then redis.call('HSET', R, 'w', 1) end  -- a waiter: see notify()
local reply = redis.call('HGETALL', R)
table.insert(reply, 1, now)
table.insert(reply, 1, 0)
return reply
