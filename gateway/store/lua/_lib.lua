-- Shared by every script (prepended when loaded). Keys of one record share a hash
-- tag: KEYS[1] the record, KEYS[2] the in-flight index (by lease deadline),
-- KEYS[3] the unresolved index; channel names carry the same tag, so every script
-- runs unchanged on Redis Cluster.
local function now_ms()
  -- The store's clock, never a gateway's: replicas with skewed clocks agree.
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function add_event(key, event)
  local raw = redis.call('HGET', key, 'h')
  local list = {}
  if raw then list = cjson.decode(raw) end
  list[#list + 1] = event
  redis.call('HSET', key, 'h', cjson.encode(list))
end
