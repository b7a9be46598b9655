-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Prepended to every script. The keys of one record share a hash tag:
--   KEYS[1] the record, KEYS[2] the bucket's in_flight members (by lease deadline),
--   KEYS[3..5] the record's route's unresolved, parked and claimed members (by the time
--   they entered the state), KEYS[6..7] its queued and retrying members (by due time),
--   KEYS[8] the bucket's counts of records per state and route (field `state/route`,
--   for the counted states: every one of KEYS[3..7]), KEYS[9] the record's stored
--   request (deliveries only; deleted when the key settles), KEYS[10] the bucket's
--   last success per route (written by complete.lua), KEYS[11] the route's completed
--   deliveries (by when each completed: the run log's listing; list_completed()).
--   KEYS[12], on one server (not a Cluster, whose scripts touch one slot): the route's
--   admission marks, a zset of the digests of its queued and retrying deliveries (and
--   of accepts under way) by when each was marked: its size is what delivery.max_queued
--   bounds. On a Cluster the store marks them in the route's slot itself
--   (redis/admission.py), and KEYS[12] is absent.
-- ARGV[1] is the record's index member ("digest/route"), ARGV[2] its bucket's
-- sharded channel `...:c` (same tag), so every script runs unchanged on Redis Cluster.
local R = KEYS[1]
local MEMBER, CHANNEL = ARGV[1], ARGV[2]
local INDEX = {in_flight = KEYS[2], unresolved = KEYS[3], parked = KEYS[4], claimed = KEYS[5],
  queued = KEYS[6], retrying = KEYS[7]}
local COUNTS, RQ, LS, DONE, ADMITTED = KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local SLASH = string.find(MEMBER, '/', 1, true) or 0
local ROUTE = string.sub(MEMBER, SLASH + 1)
local DIGEST = string.sub(MEMBER, 1, SLASH - 1)
local PENDING = {queued = true, retrying = true}
local COUNTED = {unresolved = true, parked = true, claimed = true, queued = true, retrying = true}

-- ARGV[i], a duration in whole milliseconds, checked at the top of a script, before it
-- writes anything: Redis does not undo a script's earlier commands when a later one
-- fails, so a PEXPIRE refused after an HSET would leave a record half changed (say
-- completed, with no expiry). 1 to 15 digits: what PEXPIRE takes, and what a Lua
-- number holds exactly. Returned as the text it is, which PEXPIRE reads as sent.
local function ms_arg(i)
  local text = ARGV[i]
  if not (string.match(text, '^%d+$') and #text <= 15) then
    error({err = 'ERR ARGV[' .. i .. '] is not a duration in milliseconds: ' .. string.sub(text, 1, 40)})
  end
  return text
end

local function now_ms()
  -- The store's clock, never a gateway's: replicas with skewed clocks agree.
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The history stored as `raw`, a list of events. Text that is not one (changed by
-- someone with write access to Redis) is replaced by an event that says so: the record
-- still moves, so a person can claim and resolve it (the gateway reads such a history
-- the same way: records.read_history).
local function history_of(raw)
  local ok, list = pcall(cjson.decode, raw)
  if ok and type(list) == 'table' and (next(list) == nil or list[1] ~= nil) then
    local whole = true
    for _, event in ipairs(list) do
      if type(event) ~= 'table' or type(event.at_ms) ~= 'number' then whole = false end
    end
    if whole then return list end
  end
  return {{at_ms = now_ms(), event = 'unreadable',
    reason = 'the stored history was damaged (not a list of events) and was replaced'}}
end

local function add_event(event)
  local raw = redis.call('HGET', R, 'h')
  local list = {}
  if raw then list = history_of(raw) end
  list[#list + 1] = event
  redis.call('HSET', R, 'h', cjson.encode(list))
end

-- Wake waiters in other processes. A claim that finds the record in flight marks
-- it `w` in the same atomic step, so a change is published exactly when someone
-- may be waiting for it: most keys never have a waiter, and skipping the publish
-- spares every replica's subscriber a message per request.
-- `notice` (optional, a function: it runs only when someone waits) gives text that
-- rides along after a newline: a completion carries its fingerprint and response,
-- so a waiter in another process replays it without reading the record again (one
-- round trip for a waiting duplicate, not two).
local function notify(notice)
  if redis.call('HEXISTS', R, 'w') == 1 then
    redis.call('SPUBLISH', CHANNEL, notice and (MEMBER .. '\n' .. notice()) or MEMBER)
  end
end

-- Keep the bucket's count of `state` records of the route: +1 or -1.
local function count(state, by)
  if redis.call('HINCRBY', COUNTS, state .. '/' .. ROUTE, by) <= 0 then
    redis.call('HDEL', COUNTS, state .. '/' .. ROUTE)
  end
end

-- Keep the route's admission marks (on one server; see KEYS[12]): a delivery that
-- starts waiting is marked, one that stops is not.
local function admission(from, to, now)
  if not ADMITTED then return end
  if PENDING[to] and not PENDING[from] then
    redis.call('ZADD', ADMITTED, now, DIGEST)
  elseif PENDING[from] and not PENDING[to] then
    redis.call('ZREM', ADMITTED, DIGEST)
  end
end

-- Move the record to `to` (state, index and counts; `from` nil for a new record),
-- publish the change.
local function move(from, to, now, score, notice)
  if INDEX[from] then redis.call('ZREM', INDEX[from], MEMBER) end
  if INDEX[to] then redis.call('ZADD', INDEX[to], score or now, MEMBER) end
  if from ~= to then
    if COUNTED[from] then count(from, -1) end
    if COUNTED[to] then count(to, 1) end
    admission(from, to, now)
  end
  redis.call('HSET', R, 's', to, 'u', now)
  notify(notice)
end

-- Delivery notices go to the bucket's `d` channel (CHANNEL with `d` for its final
-- `c`: same tag, same slot), which only processes that deliver subscribe to; `c`
-- stays for the waiters every process has.
local function due_notice(text)
  redis.call('SPUBLISH', string.sub(CHANNEL, 1, -2) .. 'd', text)
end

-- A delivery is (or will be) due: tell every process that delivers. Always published:
-- unlike a waiter, a queued delivery always has someone to wake (the workers).
local function announce(due, now, origin)
  due_notice('!d ' .. MEMBER .. ' ' .. due .. ' ' .. now .. ' ' .. origin)
end

-- Fields of a run still open: its lease, a check's lock, an operator's hold. A
-- settled record drops them (settle() here, and complete.lua, which inlines it).
local OPEN_RUN_FIELDS = {'l', 'ck', 'op', 'os'}

-- A delivery completed at `now`, kept `ttl_ms`: listed by when it completed. Its
-- record expires by itself, its entry does not: each completion trims the entries
-- completed longer than its ttl ago, whose records have expired (a listing drops one
-- whose record is gone before it is trimmed).
local function list_completed(now, ttl_ms)
  redis.call('ZADD', DONE, now, MEMBER)
  redis.call('ZREMRANGEBYSCORE', DONE, '-inf', now - tonumber(ttl_ms))
end

-- Completed records expire; released ones stay as tombstones (for their history)
-- until the ttl, and the next claim takes over from them.
-- A delivery's stored request goes in the same step.
local function settle(from, to, now, ttl_ms, notice)
  move(from, to, now, nil, notice)
  if to == 'completed' and redis.call('HEXISTS', R, 'dl') == 1 then
    list_completed(now, ttl_ms)
  end
  redis.call('HDEL', R, unpack(OPEN_RUN_FIELDS))
  redis.call('PEXPIRE', R, ttl_ms)
  redis.call('DEL', RQ)
end

local function unknown(from, to, now, reason)
  move(from, to, now)
  redis.call('HSET', R, 'why', reason)
  redis.call('HDEL', R, 'l')
  redis.call('PERSIST', R)  -- an open record never expires
  add_event({at_ms = now, event = 'unknown', reason = reason})
  if to == 'parked' then add_event({at_ms = now, event = 'parked', reason = 'route policy: park'}) end
end

-- An in_flight record whose lease ran out: its gateway died mid-request.
-- policy: 'unresolved' | 'parked' | 'release'. Returns the new state. A delivery is
-- never released (its caller got 202 and will not send it again): unresolved.
local function expire_lease(now, policy)
  if policy == 'release' and redis.call('HEXISTS', R, 'dl') == 1 then policy = 'unresolved' end
  if policy == 'release' then
    add_event({at_ms = now, event = 'released', reason = 'lease expired; route policy: release'})
    settle('in_flight', 'released', now, 86400000)
    return 'released'
  end
  unknown('in_flight', policy, now, 'lease_expired')
  return policy
end
