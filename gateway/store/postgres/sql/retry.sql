-- The attempt of a run did not complete and may be repeated: schedule the next (and
-- NOTIFY `!d`), or park the delivery when no attempt is left. $1 digest, $2 run_id,
-- $3 delay_ms (NULL: none left), $4 attempt (JSON), $5 origin, $6 reason (when parking),
-- $7 uncounted (the attempt is not the delivery's: its pick's count is taken back).
-- Returns ok: done now, or this same call was done before (same attempt recorded).
WITH t AS (SELECT gateway_now_ms() AS now),
moved AS (
    UPDATE gateway_records r SET since_ms = t.now, lease_until_ms = 0, last_attempt = $4,
        state = CASE WHEN $3::bigint IS NULL THEN 'parked' ELSE 'retrying' END,
        attempts = CASE WHEN $7::boolean THEN greatest(r.attempts - 1, 0) ELSE r.attempts END,
        due_ms = CASE WHEN $3::bigint IS NULL THEN r.due_ms ELSE t.now + $3 END,
        reason = CASE WHEN $3::bigint IS NULL THEN $6 ELSE r.reason END,
        history = r.history || jsonb_build_array(CASE WHEN $3::bigint IS NULL
            THEN jsonb_build_object('at_ms', t.now, 'event', 'parked', 'reason', $6::text,
                'attempt', $4::jsonb)
            ELSE jsonb_build_object('at_ms', t.now, 'event', 'retry_scheduled',
                'due_ms', t.now + $3, 'attempt', $4::jsonb) END)
    FROM t
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.run_id = $2 AND r.delivery
        AND r.state = 'in_flight'
    RETURNING r.state, r.due_ms, r.route
),
told AS (
    SELECT pg_notify(@channel, '!d ' || $1 || '/' || m.route || ' ' || m.due_ms || ' '
        || t.now || ' ' || $5::text)
    FROM moved m, t WHERE m.state = 'retrying'
)
SELECT EXISTS (SELECT 1 FROM moved) OR EXISTS (
        SELECT 1 FROM gateway_records r
        WHERE r.prefix = @prefix AND r.digest = $1 AND r.run_id = $2 AND r.delivery
            AND r.state IN ('retrying', 'parked') AND r.last_attempt = $4::jsonb) AS ok,
    (SELECT count(*) FROM told) AS notified
