-- A move of a route's pause (store/route_pauses.py's apply_move, the same rules): one
-- step, run alone (not with _lib.lua). KEYS[1] a hash, route -> the row as JSON, under
-- its own hash tag, so this runs unchanged on Redis Cluster.
-- ARGV: route, move, by, why, pause_after, probe_every_ms. Returns the row as JSON
-- (now_ms the script's now) and the verdict.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local route, move, by, why = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local pause_after, every = tonumber(ARGV[5]), tonumber(ARGV[6])
local held = redis.call('HGET', KEYS[1], route)
local s
if held then
  s = cjson.decode(held)
else
  s = {failures = 0, since_ms = 0, by = '', why = '', probe_ms = 0, changed_ms = 0}
end
local function verdict()
  if s.since_ms <= 0 then return 'open' end
  if s.by == 'auto' and now >= s.probe_ms then return 'probe' end
  return 'closed'
end
local answer
if move == 'refused' then
  s.failures = s.failures + 1
  if s.since_ms <= 0 and pause_after > 0 and s.failures >= pause_after then
    s.since_ms, s.by, s.why, s.probe_ms, s.changed_ms = now, 'auto', why, now + every, now
  end
elseif move == 'answered' then
  s.failures = 0
  if s.since_ms > 0 and s.by == 'auto' then
    s.since_ms, s.probe_ms, s.why, s.changed_ms = 0, 0, 'a probe was answered', now
  end
elseif move == 'probe' then
  answer = verdict()
  if answer == 'probe' then s.probe_ms = now + every end
elseif move == 'pause' then
  if s.since_ms <= 0 then s.since_ms = now end
  s.by, s.why, s.probe_ms, s.changed_ms = by, why, 0, now
else
  s.failures, s.since_ms, s.by, s.why, s.probe_ms, s.changed_ms = 0, 0, by, why, 0, now
end
if answer == nil then answer = verdict() end
local row = string.format(
  '{"failures":%d,"since_ms":%d,"by":%s,"why":%s,"probe_ms":%d,"changed_ms":%d}',
  s.failures, s.since_ms, cjson.encode(s.by), cjson.encode(s.why), s.probe_ms, s.changed_ms)
redis.call('HSET', KEYS[1], route, row)
return {row, answer, string.format('%d', now)}
