-- Free the key of the run that owns it, in flight: the request was never sent, or its
-- status is not cached. A record with a story keeps it as a released tombstone (the
-- next claim carries it on); one without is deleted. $1 digest, $2 run_id, $3 ttl_ms,
-- $4 reason. Returns (ok, notified): ok when released, or already gone.
WITH t AS (SELECT gateway_now_ms() AS now),
tomb AS (
    UPDATE gateway_records r SET state = 'released', since_ms = t.now,
        expires_ms = t.now + $3, lease_until_ms = 0, check_lock_ms = 0, holder = '',
        holder_since_ms = 0, request = NULL,
        history = r.history || jsonb_build_array(jsonb_build_object(
            'at_ms', t.now, 'event', 'released', 'reason', $4::text))
    FROM t
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.run_id = $2 AND r.state = 'in_flight'
        AND r.history <> '[]'
    RETURNING r.waiting
),
gone AS (
    DELETE FROM gateway_records r
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.run_id = $2 AND r.state = 'in_flight'
        AND r.history = '[]'
    RETURNING r.waiting
),
told AS (
    SELECT pg_notify(@channel, $1)
    FROM (SELECT waiting FROM tomb UNION ALL SELECT waiting FROM gone) c WHERE c.waiting
)
SELECT EXISTS (SELECT 1 FROM tomb) OR EXISTS (SELECT 1 FROM gone) OR NOT EXISTS (
        SELECT 1 FROM gateway_records r, t WHERE r.prefix = @prefix AND r.digest = $1
            AND (r.expires_ms IS NULL OR r.expires_ms > t.now)) AS ok,
    (SELECT count(*) FROM told) AS notified
