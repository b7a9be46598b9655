-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Claim a due delivery for an attempt by a run. ARGV: member, channel, run_id,
-- lease_ms, max_attempts, replica, park_reason. Returns, when claimed (now, or by this
-- same call before: a retry after a lost reply),
-- {1, now, request, next_member, next_due, field, value, ...}, else
-- {0, now, why ('gone' | 'not_due' | 'exhausted'), due, next_member, next_due}:
-- next is the earliest queued or retrying member of the route in this bucket.
local now = now_ms()
local rec = redis.call('HMGET', R, 's', 'due', 'n', 'r', 'dl')
local state = rec[1]

local function next_due()
  local best, score = '', 0
  for _, index in ipairs({INDEX.queued, INDEX.retrying}) do
    local head = redis.call('ZRANGE', index, 0, 0, 'WITHSCORES')
    if head[1] and (best == '' or tonumber(head[2]) < score) then
      best, score = head[1], tonumber(head[2])
    end
  end
  return best, score
end

local function picked()
  local member, score = next_due()
  local reply = {1, now, redis.call('GET', RQ) or '', member, score}
  for _, value in ipairs(redis.call('HGETALL', R)) do reply[#reply + 1] = value end
  return reply
end

if state == 'in_flight' and rec[4] == ARGV[3] and rec[5] == '1' then
  -- This run's own pick, retried after a lost reply: it is that pick. A write here
  -- lets a WAIT after it confirm the first try's write as well.
  redis.call('HSET', R, 'r', ARGV[3])
  return picked()
end
local why, due = '', 0
if not (state and PENDING[state]) then
  why = 'gone'
  if not state then  -- index entries of a record now gone
    for _, pending in ipairs({'queued', 'retrying'}) do
      if redis.call('ZREM', INDEX[pending], MEMBER) > 0 then count(pending, -1) end
    end
    if ADMITTED then redis.call('ZREM', ADMITTED, DIGEST) end
  end
elseif tonumber(rec[2] or '0') > now then
  why, due = 'not_due', tonumber(rec[2])
elseif tonumber(rec[3] or '0') >= tonumber(ARGV[5]) then
  why = 'exhausted'
  redis.call('HSET', R, 'why', ARGV[7])
  redis.call('HDEL', R, 'due')
  add_event({at_ms = now, event = 'parked', reason = ARGV[7]})
  move(state, 'parked', now)
end
if why ~= '' then
  local member, score = next_due()
  return {0, now, why, due, member, score}
end
local lease = now + tonumber(ARGV[4])
local attempt = tonumber(rec[3] or '0') + 1
redis.call('HSET', R, 'r', ARGV[3], 'l', lease, 'n', attempt)
redis.call('HDEL', R, 'due')
add_event({at_ms = now, event = 'attempt', attempt = attempt, run_id = ARGV[3], replica = ARGV[6]})
move(state, 'in_flight', now, lease)
due_notice('!t ' .. MEMBER)
return picked()
