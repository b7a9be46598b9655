-- The record's hash fields: see FIELDS in gateway/store/redis/record.py (this script reads none).
-- A listing page's candidates from one bucket (read only; redis/listing.py merges the
-- buckets). KEYS: state indexes of this bucket (zsets of `digest/route` by place).
-- ARGV: direction ('a' after the cursor, ascending; 'b' before it, descending), the
-- cursor's place and digest ('' and '' for the first page), n (how many to return),
-- the lowest place listed ('' none), then per key: the highest place listed ('' none)
-- and the route a member must have ('' any: the in_flight index holds every route's).
-- Returns up to n entries {member, place, key#, ...}, the first n of this bucket's keys
-- in the walk's order of (place, digest).
-- Not prepended with _lib.lua: it reads no record.
local backward = ARGV[1] == 'b'
local at, after = tonumber(ARGV[2]), ARGV[3]
local n = tonumber(ARGV[4])
local floor = ARGV[5]
local CHUNK = 64

local function digest_of(member)
  return string.sub(member, 1, (string.find(member, '/', 1, true) or 0) - 1)
end

local function route_of(member)
  return string.sub(member, (string.find(member, '/', 1, true) or 0) + 1)
end

-- Whether (place, digest) lies beyond the cursor in the walk's direction.
local function beyond(place, digest)
  if not at then return true end
  if backward then return place < at or (place == at and digest < after) end
  return place > at or (place == at and digest > after)
end

local found = {}
for i, key in ipairs(KEYS) do
  local top, route = ARGV[4 + 2 * i], ARGV[5 + 2 * i]
  local lo, hi = floor ~= '' and floor or '-inf', top ~= '' and top or '+inf'
  if at then
    if backward then
      if tonumber(hi) == nil or at < tonumber(hi) then hi = tostring(at) end
    elseif tonumber(lo) == nil or at > tonumber(lo) then
      lo = tostring(at)
    end
  end
  local taken, offset = 0, 0
  while taken < n do
    local chunk
    if backward then
      chunk = redis.call('ZRANGE', key, hi, lo, 'BYSCORE', 'REV', 'LIMIT', offset, CHUNK, 'WITHSCORES')
    else
      chunk = redis.call('ZRANGE', key, lo, hi, 'BYSCORE', 'LIMIT', offset, CHUNK, 'WITHSCORES')
    end
    for j = 1, #chunk, 2 do
      local member, place = chunk[j], tonumber(chunk[j + 1])
      local digest = digest_of(member)
      if beyond(place, digest) and (route == '' or route_of(member) == route) then
        found[#found + 1] = {place, digest, member, i}
        taken = taken + 1
        if taken >= n then break end
      end
    end
    if #chunk < 2 * CHUNK then break end
    offset = offset + CHUNK
  end
end
table.sort(found, function(x, y)
  if x[1] ~= y[1] then
    if backward then return x[1] > y[1] end
    return x[1] < y[1]
  end
  if backward then return x[2] > y[2] end
  return x[2] < y[2]
end)
local reply = {}
for j = 1, math.min(n, #found) do
  reply[#reply + 1] = found[j][3]
  reply[#reply + 1] = string.format('%d', found[j][1])
  reply[#reply + 1] = found[j][4]
end
return reply
