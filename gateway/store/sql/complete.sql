-- Store the response of the run that owns the key, in flight or unresolved (a late
-- answer is still the answer). $1 digest, $2 run_id, $3 response (sealed), $4 ttl_ms,
-- $5 origin, $6 the delivery's attempt (JSON) or NULL, $7 whether the status is below
-- 500 (the route's last success: see `seen`). Returns (ok, notified): ok when
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
    RETURNING r.waiting, r.fingerprint, r.route
),
-- The route's last success, to the second. An UPDATE locks only the rows it changes,
-- so the completions within a second of the last write skip the row instead of
-- queueing on its lock until each one commits (an ON CONFLICT DO UPDATE ... WHERE
-- would lock it every time); a route's first success inserts it.
seen AS (
    UPDATE gateway_successes s SET at_ms = t.now FROM done d, t
    WHERE $7 AND s.prefix = @prefix AND s.route = d.route AND s.at_ms < t.now - 1000
),
first_seen AS (
    INSERT INTO gateway_successes (prefix, route, at_ms)
    SELECT @prefix, d.route, t.now FROM done d, t
    WHERE $7 AND NOT EXISTS (
        SELECT 1 FROM gateway_successes s WHERE s.prefix = @prefix AND s.route = d.route)
    ON CONFLICT DO NOTHING
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
