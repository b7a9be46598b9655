-- The record's hash fields: see FIELDS in gateway/store/redis/record.py (this script reads none).
-- A route's admission marks on a Redis Cluster (redis/admission.py): the zset
-- KEYS[1], in the route's own slot, of the digests of its queued and retrying
-- deliveries (and of accepts under way), by when each was marked. Its size is what
-- delivery.max_queued bounds. On one server the record scripts keep it themselves.
-- ARGV[1] the operation:
--   'take', digest, limit: mark the digest for an accept if it is marked already
--       (returns 2) or fewer than `limit` are (returns 1); else returns 0 (full).
--   'mark', digest: a delivery waits again (a retry scheduled, a requeue); returns 1.
--   'drop', digest: a delivery stopped waiting (picked, parked); returns 1.
--   'repair', grace_ms, +digest | -digest ...: what the buckets said just before (the
--       store read every bucket's waiting deliveries): +d waits, so it is marked if it
--       is not; -d does not, so its mark goes, but only one older than grace_ms (a
--       younger one may be an accept under way, or a delivery that started waiting
--       after the buckets were read). Returns how many marks were added or dropped.
-- Not prepended with _lib.lua: it reads no record.
local MARKS, op = KEYS[1], ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if op == 'take' then
  if redis.call('ZSCORE', MARKS, ARGV[2]) then
    redis.call('ZADD', MARKS, now, ARGV[2])
    return 2
  end
  if redis.call('ZCARD', MARKS) < tonumber(ARGV[3]) then
    redis.call('ZADD', MARKS, now, ARGV[2])
    return 1
  end
  return 0
elseif op == 'mark' then
  redis.call('ZADD', MARKS, now, ARGV[2])
  return 1
elseif op == 'drop' then
  redis.call('ZREM', MARKS, ARGV[2])
  return 1
end
-- 'repair'
local mended, oldest = 0, now - tonumber(ARGV[2])
for i = 3, #ARGV do
  local sign, digest = string.sub(ARGV[i], 1, 1), string.sub(ARGV[i], 2)
  if sign == '+' then
    mended = mended + redis.call('ZADD', MARKS, 'NX', now, digest)
  else
    local at = redis.call('ZSCORE', MARKS, digest)
    if at and tonumber(at) < oldest then
      mended = mended + redis.call('ZREM', MARKS, digest)
    end
  end
end
return mended
