-- A rate limit's bucket (store/rate.py, Store.take_token): one step, run alone (not
-- with _lib.lua), on the server's clock. KEYS[1] the bucket's tat in ms, as text.
-- ARGV: the interval between tokens in ms, the burst. Returns the wait in ms as text
-- ("0": a token was taken); a number would come back cut to an integer.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local step, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local start = math.max(now, tonumber(redis.call('GET', KEYS[1]) or '0'))
local allowed_at = start + step - burst * step
if allowed_at > now then
  return string.format('%.3f', allowed_at - now)
end
-- Kept while it still holds back a take; after that an absent key reads as a quiet spell.
redis.call('SET', KEYS[1], string.format('%.3f', start + step), 'PX', math.ceil(start + step - now) + 1000)
return '0'
