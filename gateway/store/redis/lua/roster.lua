-- The operator roster (store/operator_roster.py): one step, run alone (not with _lib.lua).
-- KEYS[1] a hash, entry -> "<since_ms> <mark>"; KEYS[2] the last time given out. Both
-- share one hash tag, so this runs unchanged on Redis Cluster.
-- ARGV: entry, mark, entry, mark, ... (the roster wanted). Returns the roster as the
-- hash then holds it: entry, "<since_ms> <mark>", ...
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local since = math.max(now, tonumber(redis.call('GET', KEYS[2]) or '0') + 1)
local wanted = {}
for i = 1, #ARGV, 2 do wanted[ARGV[i]] = ARGV[i + 1] end
local stored = redis.call('HGETALL', KEYS[1])
for i = 1, #stored, 2 do
  if wanted[stored[i]] == nil then redis.call('HDEL', KEYS[1], stored[i]) end
end
local out, renewed = {}, false
for i = 1, #ARGV, 2 do
  local entry, mark = ARGV[i], ARGV[i + 1]
  local held = redis.call('HGET', KEYS[1], entry)
  if not held or string.sub(held, (string.find(held, ' ', 1, true) or #held) + 1) ~= mark then
    held = string.format('%d', since) .. ' ' .. mark
    redis.call('HSET', KEYS[1], entry, held)
    renewed = true
  end
  out[#out + 1] = entry
  out[#out + 1] = held
end
if renewed then redis.call('SET', KEYS[2], string.format('%d', since)) end
return out
