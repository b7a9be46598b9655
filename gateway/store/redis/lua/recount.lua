-- The record's hash fields: see FIELDS in gateway/store/redis/record.py (this script reads none).
-- Make one bucket's counts what its indexes hold (redis/listing.py's repair_counts).
-- The scripts keep both in one step, so they only drift apart if a script failed
-- between its writes; this finds and mends that. It also files the members of an
-- older layout's indexes (one per state for every route: `i:unresolved`, `i:parked`,
-- `i:claimed`, and the pending counts `qr`) into the route's own, once.
-- KEYS[1] the bucket's counts, KEYS[2..4] the older layout's unresolved, parked and
-- claimed indexes, KEYS[5] its `qr`; then, for each route ARGV[i], five keys: its
-- unresolved, parked, claimed, queued and retrying indexes.
-- Returns how many counts were wrong (or members refiled).
-- Not prepended with _lib.lua: it reads no record.
local STATES = {'unresolved', 'parked', 'claimed', 'queued', 'retrying'}
local COUNTS = KEYS[1]
local routes = {}
for i, route in ipairs(ARGV) do routes[route] = 5 + 5 * (i - 1) end
local mended = 0
for s = 1, 3 do  -- the older layout's indexes: every member to its route's
  local old = KEYS[1 + s]
  local members = redis.call('ZRANGE', old, 0, -1, 'WITHSCORES')
  for j = 1, #members, 2 do
    local member = members[j]
    local base = routes[string.sub(member, (string.find(member, '/', 1, true) or 0) + 1)]
    if base then
      redis.call('ZADD', KEYS[base + s], members[j + 1], member)
      redis.call('ZREM', old, member)
      mended = mended + 1
    end
  end
end
redis.call('DEL', KEYS[5])
local wanted = {}
for i, route in ipairs(ARGV) do
  for s, state in ipairs(STATES) do
    local field = state .. '/' .. route
    local n = redis.call('ZCARD', KEYS[5 + 5 * (i - 1) + s])
    wanted[field] = true
    local kept = tonumber(redis.call('HGET', COUNTS, field) or '0')
    if kept ~= n then
      mended = mended + 1
      if n > 0 then redis.call('HSET', COUNTS, field, n) else redis.call('HDEL', COUNTS, field) end
    end
  end
end
return mended
