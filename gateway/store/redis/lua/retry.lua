-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- The attempt of a run did not complete and may be repeated: schedule the next, or
-- park the delivery when no attempt is left. ARGV: member, channel, run_id, delay_ms
-- ('' : none left), attempt (JSON), origin, reason (when parking), uncounted ('1': the
-- attempt is not the delivery's, so its pick's count is taken back).
-- Returns 1 when done (or this same call was done before), 0 otherwise: nothing changes.
local rec = redis.call('HMGET', R, 's', 'r', 'dl', 'la', 'n')
local state = rec[1]
if not state or rec[2] ~= ARGV[3] or rec[3] ~= '1' then return 0 end
if (state == 'retrying' or state == 'parked') and rec[4] == ARGV[5] then return 1 end
if state ~= 'in_flight' then return 0 end
local now = now_ms()
local attempt = cjson.decode(ARGV[5])
redis.call('HSET', R, 'la', ARGV[5])
redis.call('HDEL', R, 'l')
if ARGV[8] == '1' then
  redis.call('HSET', R, 'n', math.max(0, (tonumber(rec[5]) or 0) - 1))
end
if ARGV[4] ~= '' then
  local due = now + tonumber(ARGV[4])
  redis.call('HSET', R, 'due', due)
  add_event({at_ms = now, event = 'retry_scheduled', due_ms = due, attempt = attempt})
  move('in_flight', 'retrying', now, due)
  announce(due, now, ARGV[6])
  return 1
end
redis.call('HSET', R, 'why', ARGV[7])
add_event({at_ms = now, event = 'parked', reason = ARGV[7], attempt = attempt})
move('in_flight', 'parked', now)
return 1
