-- Claim a free key for a run, or read what is there: one round trip (lua/claim.lua's
-- twin). Free: no row, a released tombstone (its history carried on), a settled row
-- past its expiry (absent), or an in-flight row whose lease ran out on a route whose
-- policy is release (not a delivery: its caller got 202 and will not send it again).
-- $1 digest, $2 route, $3 key, $4 run_id, $5 fingerprint, $6 lease_ms, $7 expired-lease
-- policy. Returns (outcome, now, record): outcome 1 claimed by $4; 0 the record as found,
-- marked `waiting` when in flight (its changes are then NOTIFYed). No row: a first claim
-- committed after this statement's snapshot was taken; the caller runs it again.
WITH t AS (SELECT gateway_now_ms() AS now),
found AS (
    SELECT @record(r), r.expires_ms, coalesce(r.expires_ms <= t.now, false)
        OR r.state = 'released' OR (r.state = 'in_flight' AND r.lease_until_ms <= t.now
            AND $7 = 'release' AND NOT r.delivery) AS free
    FROM gateway_records r, t WHERE r.prefix = @prefix AND r.digest = $1
),
claimed AS (
    INSERT INTO gateway_records AS r (prefix, digest, route, key, state, run_id, fingerprint,
                                      created_ms, since_ms, lease_until_ms)
    SELECT @prefix, $1, $2, $3, 'in_flight', $4, $5, t.now, t.now, t.now + $6 FROM t
    -- A row this snapshot sees taken is not touched: a replay locks nothing, so it
    -- writes no WAL and its commit waits for no fsync.
    WHERE NOT EXISTS (SELECT 1 FROM found WHERE NOT found.free)
    ON CONFLICT (prefix, digest) DO UPDATE SET
        route = excluded.route, key = excluded.key, state = 'in_flight',
        run_id = excluded.run_id, fingerprint = excluded.fingerprint,
        created_ms = excluded.created_ms, since_ms = excluded.since_ms,
        lease_until_ms = excluded.lease_until_ms, expires_ms = NULL, response = NULL,
        reason = '', holder = '', holder_since_ms = 0, check_lock_ms = 0, check_token = '',
        last_check_ms = 0, reconcile = '{}', waiting = false, delivery = false, attempts = 0,
        due_ms = 0, last_attempt = '{}', token = NULL, request = NULL,
        history = CASE
            WHEN r.expires_ms <= excluded.created_ms THEN '[]'  -- gone: nothing to carry
            WHEN r.state = 'in_flight' THEN r.history || jsonb_build_array(jsonb_build_object(
                'at_ms', excluded.created_ms, 'event', 'released',
                'reason', 'lease expired; route policy: release'))
            ELSE r.history
        END
    WHERE r.expires_ms <= excluded.created_ms OR r.state = 'released'
        OR (r.state = 'in_flight' AND r.lease_until_ms <= excluded.created_ms
            AND $7 = 'release' AND NOT r.delivery)
    RETURNING @record(r)
),
marked AS (
    UPDATE gateway_records r SET waiting = true FROM t
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.state = 'in_flight'
        AND r.lease_until_ms > t.now AND NOT r.waiting AND NOT EXISTS (SELECT 1 FROM claimed)
    RETURNING @record(r)
)
SELECT 1 AS outcome, t.now, c.* FROM claimed c, t
UNION ALL
SELECT 0, t.now, m.* FROM marked m, t
UNION ALL
SELECT 0, t.now, @record(f) FROM found f, t
WHERE NOT f.free AND NOT EXISTS (SELECT 1 FROM claimed) AND NOT EXISTS (SELECT 1 FROM marked)
