-- Hand an unresolved record to a person. $1 digest, $2 reason. Returns (ok, notified).
WITH t AS (SELECT gateway_now_ms() AS now),
moved AS (
    UPDATE gateway_records r SET state = 'parked', since_ms = t.now, check_lock_ms = 0,
        history = r.history || jsonb_build_array(jsonb_build_object(
            'at_ms', t.now, 'event', 'parked', 'reason', $2::text))
    FROM t
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.state = 'unresolved'
    RETURNING r.waiting
),
told AS (SELECT pg_notify(@channel, $1) FROM moved m WHERE m.waiting)
SELECT EXISTS (SELECT 1 FROM moved) AS ok, (SELECT count(*) FROM told) AS notified
