-- Claim a due delivery of a route for an attempt by a run: Technique 3 ("claim, then
-- process") of "Make scheduled job handlers idempotent: safe to run twice".
-- The hint if it is due, else the route's earliest due one, each FOR UPDATE SKIP LOCKED,
-- so replicas picking at once never take the same row (nor wait on each other). One at
-- or over the attempt limit is parked instead: no attempt over the limit ever starts.
-- $1 route, $2 hint digest, $3 run_id, $4 lease_ms, $5 max_attempts, $6 replica,
-- $7 park_reason. Returns one row: now; the hint as found (state, due, run_id: `why`,
-- and this very pick retried); the next pending delivery of the route; and the picked
-- (or parked) record with its request, all NULL when nothing was.
WITH t AS (SELECT gateway_now_ms() AS now),
hint AS (
    SELECT r.state, r.due_ms, r.run_id FROM gateway_records r
    WHERE r.prefix = @prefix AND r.digest = $2
),
hinted AS (
    SELECT r.digest FROM gateway_records r, t
    WHERE r.prefix = @prefix AND r.digest = $2 AND r.route = $1
        AND r.state IN ('queued', 'retrying') AND r.due_ms <= t.now
    FOR UPDATE OF r SKIP LOCKED
),
earliest AS (
    SELECT r.digest FROM gateway_records r, t
    WHERE r.prefix = @prefix AND r.route = $1 AND r.state IN ('queued', 'retrying')
        AND r.due_ms <= t.now AND NOT EXISTS (SELECT 1 FROM hinted)
        -- this very pick, retried after a lost connection, took the hint: not another
        AND NOT EXISTS (SELECT 1 FROM hint WHERE hint.state = 'in_flight' AND hint.run_id = $3)
    ORDER BY r.due_ms, r.digest LIMIT 1
    FOR UPDATE OF r SKIP LOCKED
),
chosen AS (SELECT digest FROM hinted UNION ALL SELECT digest FROM earliest),
picked AS (
    UPDATE gateway_records r SET since_ms = t.now, due_ms = 0,
        state = CASE WHEN r.attempts >= $5 THEN 'parked' ELSE 'in_flight' END,
        run_id = CASE WHEN r.attempts >= $5 THEN r.run_id ELSE $3 END,
        lease_until_ms = CASE WHEN r.attempts >= $5 THEN 0 ELSE t.now + $4 END,
        attempts = CASE WHEN r.attempts >= $5 THEN r.attempts ELSE r.attempts + 1 END,
        reason = CASE WHEN r.attempts >= $5 THEN $7 ELSE r.reason END,
        history = r.history || jsonb_build_array(CASE WHEN r.attempts >= $5
            THEN jsonb_build_object('at_ms', t.now, 'event', 'parked', 'reason', $7::text)
            ELSE jsonb_build_object('at_ms', t.now, 'event', 'attempt',
                'attempt', r.attempts + 1, 'run_id', $3::text, 'replica', $6::text) END)
    FROM t, chosen c
    WHERE r.prefix = @prefix AND r.digest = c.digest
    RETURNING r.digest, r.request, @record(r)
),
taken AS (
    SELECT pg_notify(@channel, '!t ' || p.digest || '/' || $1) FROM picked p
    WHERE p.state = 'in_flight'
),
following AS (
    SELECT r.digest, r.key, r.due_ms FROM gateway_records r
    WHERE r.prefix = @prefix AND r.route = $1 AND r.state IN ('queued', 'retrying')
        AND r.digest NOT IN (SELECT digest FROM chosen)
    ORDER BY r.due_ms, r.digest LIMIT 1
)
SELECT t.now, h.state AS hint_state, h.due_ms AS hint_due, h.run_id AS hint_run,
    f.digest AS next_digest, f.key AS next_key, f.due_ms AS next_due,
    (SELECT count(*) FROM taken) AS notified, p.*
FROM t LEFT JOIN picked p ON true LEFT JOIN hint h ON true LEFT JOIN following f ON true
