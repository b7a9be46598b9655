-- The run that owns the key sent the request and lost the answer. $1 digest, $2 run_id,
-- $3 reason, $4 target ('unresolved' or 'parked'). Returns (ok, notified): ok when the
-- record is, now, open for this reason (a repeated call reports success again).
WITH t AS (SELECT gateway_now_ms() AS now),
moved AS (
    UPDATE gateway_records r SET state = $4, since_ms = t.now, reason = $3, lease_until_ms = 0,
        history = r.history || jsonb_build_array(jsonb_build_object(
                'at_ms', t.now, 'event', 'unknown', 'reason', $3::text))
            || CASE WHEN $4 = 'parked' THEN jsonb_build_array(jsonb_build_object(
                'at_ms', t.now, 'event', 'parked', 'reason', 'route policy: park'))
            ELSE '[]' END
    FROM t
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.run_id = $2 AND r.state = 'in_flight'
    RETURNING r.waiting
),
told AS (SELECT pg_notify(@channel, $1) FROM moved m WHERE m.waiting)
SELECT EXISTS (SELECT 1 FROM moved) OR EXISTS (
        SELECT 1 FROM gateway_records r WHERE r.prefix = @prefix AND r.digest = $1
            AND r.run_id = $2 AND r.state = $4 AND r.reason = $3) AS ok,
    (SELECT count(*) FROM told) AS notified
