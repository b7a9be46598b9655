-- Store the response of the run that owns the key, in flight or unresolved (a late
-- answer is still the answer). $1 digest, $2 run_id, $3 response (sealed), $4 ttl_ms,
-- $5 origin, $6 the delivery's attempt (JSON) or NULL. Returns (ok, notified): ok when
-- the record is, now, completed by this run (a retried completion is success, not a
-- second write). A waiter's notice carries the fingerprint and response when they fit
-- in NOTIFY's payload, so a duplicate in another process replays without a re-read.
WITH t AS (SELECT gateway_now_ms() AS now),
done AS (
    UPDATE gateway_records r SET state = 'completed', since_ms = t.now, response = $3,
        expires_ms = t.now + $4, lease_until_ms = 0, check_lock_ms = 0, holder = '',
        holder_since_ms = 0, reason = '', request = NULL,
        last_attempt = CASE WHEN r.delivery AND $6::jsonb IS NOT NULL THEN $6::jsonb
                            ELSE r.last_attempt END,
        history = CASE WHEN r.state = 'unresolved' OR r.history <> '[]'
            THEN r.history || jsonb_build_array(jsonb_build_object(
                'at_ms', t.now, 'event', 'completed', 'origin', $5::text))
            ELSE r.history END
    FROM t
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.run_id = $2
        AND r.state IN ('in_flight', 'unresolved')
    RETURNING r.waiting, r.fingerprint
),
told AS (
    SELECT pg_notify(@channel, $1 || CASE WHEN length($3) <= 5000
        THEN E'\n' || d.fingerprint || E'\n' || encode($3, 'base64') ELSE '' END)
    FROM done d WHERE d.waiting
)
SELECT EXISTS (SELECT 1 FROM done) OR EXISTS (
        SELECT 1 FROM gateway_records r, t
        WHERE r.prefix = @prefix AND r.digest = $1 AND r.run_id = $2
            AND r.state = 'completed' AND r.expires_ms > t.now) AS ok,
    (SELECT count(*) FROM told) AS notified
