-- Queue a delivery on a free key, or read what is there: one round trip, a delivery's
-- claim (lua/accept.lua's twin; free as in claim.sql). $1 digest, $2 route, $3 key,
-- $4 run_id, $5 fingerprint, $6 request (sealed), $7 token (sealed), $8 admit, $9
-- expired-lease policy, $10 origin. Returns (outcome, now, record): 1 queued (and
-- NOTIFYed `!d`), 0 the record found (not released, not past its expiry). No row: the
-- key was free and $8 false ("full": nothing stored), or a first claim committed after
-- this statement's snapshot (the caller runs it again).
WITH t AS (SELECT gateway_now_ms() AS now),
found AS (
    SELECT @record(r), r.expires_ms, coalesce(r.expires_ms <= t.now, false)
        OR r.state = 'released' OR (r.state = 'in_flight' AND r.lease_until_ms <= t.now
            AND $9 = 'release' AND NOT r.delivery) AS free
    FROM gateway_records r, t WHERE r.prefix = @prefix AND r.digest = $1
),
queued AS (
    INSERT INTO gateway_records AS r (prefix, digest, route, key, state, run_id, fingerprint,
        created_ms, since_ms, delivery, due_ms, token, request)
    SELECT @prefix, $1, $2, $3, 'queued', $4, $5, t.now, t.now, true, t.now, $7, $6
    FROM t WHERE $8 AND NOT EXISTS (SELECT 1 FROM found WHERE NOT found.free)
    ON CONFLICT (prefix, digest) DO UPDATE SET
        route = excluded.route, key = excluded.key, state = 'queued',
        run_id = excluded.run_id, fingerprint = excluded.fingerprint,
        created_ms = excluded.created_ms, since_ms = excluded.since_ms, lease_until_ms = 0,
        expires_ms = NULL, response = NULL, reason = '', holder = '', holder_since_ms = 0,
        check_lock_ms = 0, check_token = '', last_check_ms = 0, reconcile = '{}',
        waiting = false, delivery = true, attempts = 0, due_ms = excluded.due_ms,
        last_attempt = '{}', token = excluded.token, request = excluded.request,
        history = CASE
            WHEN r.expires_ms <= excluded.created_ms THEN '[]'
            WHEN r.state = 'in_flight' THEN r.history || jsonb_build_array(jsonb_build_object(
                'at_ms', excluded.created_ms, 'event', 'released',
                'reason', 'lease expired; route policy: release'))
            ELSE r.history
        END
    WHERE r.expires_ms <= excluded.created_ms OR r.state = 'released'
        OR (r.state = 'in_flight' AND r.lease_until_ms <= excluded.created_ms
            AND $9 = 'release' AND NOT r.delivery)
    RETURNING @record(r)
),
told AS (
    SELECT pg_notify(@channel, '!d ' || $1 || '/' || $2 || ' ' || q.due_ms || ' '
        || q.due_ms || ' ' || $10::text)
    FROM queued q
)
SELECT 1 AS outcome, t.now, q.*, (SELECT count(*) FROM told) AS notified FROM queued q, t
UNION ALL
SELECT 0, t.now, @record(f), 0 FROM found f, t
WHERE NOT EXISTS (SELECT 1 FROM queued) AND NOT f.free
