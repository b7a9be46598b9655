-- The record's hash fields (s, r, l, resp, ...): see FIELDS in gateway/store/redis/record.py.
-- A copied record, written as it is (Store.import_records): no move, no notice. Filed in
-- its state's index at its listing place and counted as the scripts count it; its
-- admission mark on one server. ARGV: member, channel, then state, since, run_id,
-- fingerprint, created, route, key, lease, response, reason, history, check lock, last
-- check, reconcile, holder, holder since, delivery ('1' or ''), attempts, due, last
-- attempt, token, request, the ms it has left ('': it never expires), its listing place.
-- A field whose value is '' is left out, as the other scripts leave it (it reads as its
-- default). Returns 1 when written, 0 when the key holds a live record (nothing changes).
local ttl = ARGV[25] ~= '' and ms_arg(25) or nil
if redis.call('EXISTS', R) == 1 then return 0 end
local state = ARGV[3]
redis.call('HSET', R, 's', state, 'u', ARGV[4], 'r', ARGV[5], 'f', ARGV[6], 'c', ARGV[7],
  'rt', ARGV[8], 'k', ARGV[9])
if ARGV[10] ~= '' then redis.call('HSET', R, 'l', ARGV[10]) end
if ARGV[11] ~= '' then redis.call('HSET', R, 'resp', ARGV[11]) end
if ARGV[12] ~= '' then redis.call('HSET', R, 'why', ARGV[12]) end
if ARGV[13] ~= '' then redis.call('HSET', R, 'h', ARGV[13]) end
if ARGV[14] ~= '' then redis.call('HSET', R, 'ck', ARGV[14]) end
if ARGV[15] ~= '' then redis.call('HSET', R, 'lc', ARGV[15]) end
if ARGV[16] ~= '' then redis.call('HSET', R, 'rc', ARGV[16]) end
if ARGV[17] ~= '' then redis.call('HSET', R, 'op', ARGV[17], 'os', ARGV[18]) end
if ARGV[19] ~= '' then redis.call('HSET', R, 'dl', '1', 'n', ARGV[20], 'due', ARGV[21]) end
if ARGV[22] ~= '' then redis.call('HSET', R, 'la', ARGV[22]) end
if ARGV[23] ~= '' then redis.call('HSET', R, 'tk', ARGV[23]) end
if ARGV[24] ~= '' then redis.call('SET', RQ, ARGV[24]) end
if ttl then redis.call('PEXPIRE', R, ttl) end
if INDEX[state] then redis.call('ZADD', INDEX[state], ARGV[26], MEMBER) end
if state == 'completed' and ARGV[19] ~= '' then redis.call('ZADD', DONE, ARGV[26], MEMBER) end
if COUNTED[state] then count(state, 1) end
if ADMITTED and PENDING[state] then redis.call('ZADD', ADMITTED, ARGV[26], DIGEST) end
return 1
