-- Claim a free key for a run, or read what is there: one round trip.
-- ARGV: run_id, fingerprint, lease_ms, route, key, index member, channel
-- Returns {1, now} when claimed, else {0, now, field, value, ...}.
local now = now_ms()
local state = redis.call('HGET', KEYS[1], 's')
if not state then
  local lease = now + tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], 's', 'in_flight', 'r', ARGV[1], 'f', ARGV[2], 'l', lease,
    'c', now, 'u', now, 'rt', ARGV[4], 'k', ARGV[5])
  redis.call('ZADD', KEYS[2], lease, ARGV[6])
  return {1, now}
end
if state == 'in_flight' and tonumber(redis.call('HGET', KEYS[1], 'l')) <= now then
  -- The gateway holding the lease died: the outcome is unknown, never released blind.
  redis.call('HSET', KEYS[1], 's', 'unresolved', 'why', 'lease_expired', 'u', now)
  redis.call('HDEL', KEYS[1], 'l')
  redis.call('ZREM', KEYS[2], ARGV[6])
  redis.call('ZADD', KEYS[3], now, ARGV[6])
  add_event(KEYS[1], {at_ms = now, event = 'unknown', reason = 'lease_expired'})
  redis.call('SPUBLISH', ARGV[7], ARGV[6])
end
local reply = redis.call('HGETALL', KEYS[1])
table.insert(reply, 1, now)
table.insert(reply, 1, 0)
return reply
