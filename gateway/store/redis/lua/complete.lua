-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- Store the response of the run that owns the key, in flight or unresolved (a late
-- answer is still the answer). ARGV: member, channel, run_id, response, ttl_ms, origin,
-- attempt (JSON, or ''), '1' for a records.is_success status (the route's last success,
-- kept per bucket in LS; the response itself may be sealed) else ''. Returns 1 when
-- the record is (now) completed by this run, else 0: nothing changes. Every first
-- request runs this, so it reads the record once (HMGET) and does what settle() and
-- notify() do inline: 6 commands where the helpers take 11 (a success adds reading
-- and writing LS; a delivery's, deleting its request, listing it as completed and
-- its last attempt).
local ttl = ms_arg(5)
local rec = redis.call('HMGET', R, 's', 'r', 'h', 'w', 'f', 'dl')
local state = rec[1]
if not state or rec[2] ~= ARGV[3] then return 0 end
if state == 'completed' then return 1 end  -- our own completion, retried
if state ~= 'in_flight' and state ~= 'unresolved' then return 0 end
local now = now_ms()
if state == 'unresolved' or rec[3] then
  add_event({at_ms = now, event = 'completed', origin = ARGV[6]})
end
redis.call('ZREM', INDEX[state], MEMBER)
if state == 'unresolved' then count('unresolved', -1) end  -- a late answer
redis.call('HSET', R, 'resp', ARGV[4], 's', 'completed', 'u', now)
redis.call('HDEL', R, 'why', unpack(OPEN_RUN_FIELDS))
redis.call('PEXPIRE', R, ttl)
if rec[6] then
  redis.call('DEL', RQ)
  list_completed(now, ttl)
  if ARGV[7] ~= '' then redis.call('HSET', R, 'la', ARGV[7]) end
end
if ARGV[8] == '1' then  -- newer only: a master's clock may step back (a failover)
  local seen = redis.call('HGET', LS, ROUTE)
  if not seen or tonumber(seen) < now then redis.call('HSET', LS, ROUTE, now) end
end
if rec[4] then  -- someone waits (see notify): the notice carries the response
  redis.call('SPUBLISH', CHANNEL, MEMBER .. '\n' .. rec[5] .. '\n' .. ARGV[4])
end
return 1
