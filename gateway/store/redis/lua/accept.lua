-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Queue a delivery on a free key, or read what is there: one round trip, a
-- delivery's claim. ARGV: member, channel, run_id, fingerprint, route, key, request
-- (sealed), token (sealed), limit (the route's delivery.max_queued; '' none),
-- expired-lease policy, origin, delay (ms after now: when the first attempt is due).
-- On one server the limit is decided here, on the
-- route's admission marks (KEYS[12]); on a Cluster the store decided it on the
-- route's slot first and sends '' (admitted) or '0' (full).
-- Returns {1, now} queued, {2, now} full (not admitted: nothing stored), else
-- {0, now, field, value, ...} (the record; its request is not in the hash).
local now = now_ms()
local state = redis.call('HGET', R, 's')
if state == 'in_flight' and tonumber(redis.call('HGET', R, 'l')) <= now then
  state = expire_lease(now, ARGV[10])
end
if not state or state == 'released' then
  local limit = tonumber(ARGV[9])
  if limit and not (ADMITTED and (redis.call('ZCARD', ADMITTED) < limit
      or redis.call('ZSCORE', ADMITTED, DIGEST))) then
    return {2, now}
  end
  local history = false
  if state then  -- a released tombstone: its story goes on in the delivery
    history = redis.call('HGET', R, 'h')
    redis.call('DEL', R)
  end
  -- move(nil, 'queued', now, now) and announce(now, now, origin), inlined as claim.lua
  -- inlines its move: one HSET for every field, no notify() (a new record has no
  -- waiter), and `now` spelled once (Lua would format the number for each argument).
  local at = string.format('%d', now)
  local due = at
  if ARGV[12] ~= '0' then due = string.format('%d', now + tonumber(ARGV[12])) end
  redis.call('HSET', R, 's', 'queued', 'u', at, 'r', ARGV[3], 'f', ARGV[4], 'c', at,
    'rt', ARGV[5], 'k', ARGV[6], 'dl', '1', 'n', '0', 'due', due, 'tk', ARGV[8])
  if history then redis.call('HSET', R, 'h', history) end
  redis.call('SET', RQ, ARGV[7])
  redis.call('ZADD', INDEX.queued, due, MEMBER)
  count('queued', 1)
  if ADMITTED then redis.call('ZADD', ADMITTED, at, DIGEST) end
  due_notice('!d ' .. MEMBER .. ' ' .. due .. ' ' .. at .. ' ' .. ARGV[11])
  return {1, now}
end
-- This run's own record: the command was retried after a lost reply. A write here
-- lets a WAIT after it confirm the first try's write as well.
if redis.call('HGET', R, 'r') == ARGV[3] then redis.call('HSET', R, 'r', ARGV[3]) end
local reply = redis.call('HGETALL', R)
table.insert(reply, 1, now)
table.insert(reply, 1, 0)
return reply
