-- Take the right to check an unresolved record with the upstream: one check at a time
-- per key across all replicas, and at most one per min_interval. $1 digest, $2 run_id,
-- $3 lock_ms, $4 min_interval_ms, $5 token. Returns ok: taken now, or already held by
-- this token (the same call, retried).
WITH t AS (SELECT gateway_now_ms() AS now),
took AS (
    UPDATE gateway_records r SET check_lock_ms = t.now + $3, last_check_ms = t.now,
        check_token = $5
    FROM t
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.state = 'unresolved' AND r.run_id = $2
        AND r.check_lock_ms <= t.now AND t.now - r.last_check_ms >= $4
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM took) OR EXISTS (
    SELECT 1 FROM gateway_records r, t
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.state = 'unresolved' AND r.run_id = $2
        AND r.check_lock_ms > t.now AND r.check_token = $5) AS ok
