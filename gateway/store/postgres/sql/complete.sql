-- Store the response of the run that owns the key, in flight or unresolved (a late
-- answer is still the answer): gateway_complete (004_hot_path.sql). $1 digest, $2
-- run_id, $3 response (sealed), $4 ttl_ms, $5 origin, $6 the delivery's attempt (JSON)
-- or NULL, $7 write the route's last success (records.is_success, asked at most once a
-- second per route). Returns ok: the record is, now, completed by this run (a retried
-- completion is success, not a second write); a waiter is NOTIFYed.
SELECT gateway_complete(@prefix, $1, $2, $3, $4, $5::text, $6::jsonb, $7, @channel) AS ok
