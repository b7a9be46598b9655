-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Free the key of the run that owns it, in flight: the request was never sent, or
-- its status is not cached. ARGV: member, channel, run_id, ttl_ms, reason.
-- Returns 1 when released (or already gone), 0 when someone else holds it.
local ttl = ms_arg(4)
local state = redis.call('HGET', R, 's')
if not state then return 1 end
if state ~= 'in_flight' or redis.call('HGET', R, 'r') ~= ARGV[3] then return 0 end
if redis.call('HEXISTS', R, 'h') == 1 then
  -- A record with a story keeps it: the next claim carries it on.
  local now = now_ms()
  add_event({at_ms = now, event = 'released', reason = ARGV[5]})
  settle('in_flight', 'released', now, ttl)
  return 1
end
-- No story: never a delivery (its attempt is an event), so no request to delete.
notify()
redis.call('DEL', R)
redis.call('ZREM', INDEX.in_flight, MEMBER)
return 1
