-- An in-flight record whose lease ran out (its gateway died mid-request) becomes what
-- the route's policy says: unresolved or parked (reason lease_expired), or, under
-- release, a released tombstone; a delivery is never released (its caller got 202):
-- unresolved. From the sweep and from a claim that found one. $1 digest, $2 policy
-- ('unresolved' | 'parked' | 'release'). Returns (now, record, notified) of the record
-- after the move; no row when the lease still holds (or someone else moved it first).
WITH t AS (SELECT gateway_now_ms() AS now),
moved AS (
    UPDATE gateway_records r SET
        state = CASE WHEN $2 = 'release' AND NOT r.delivery THEN 'released'
                     WHEN $2 = 'parked' THEN 'parked' ELSE 'unresolved' END,
        since_ms = t.now, lease_until_ms = 0,
        reason = CASE WHEN $2 = 'release' AND NOT r.delivery THEN r.reason
                      ELSE 'lease_expired' END,
        expires_ms = CASE WHEN $2 = 'release' AND NOT r.delivery THEN t.now + 86400000 END,
        history = r.history || CASE
            WHEN $2 = 'release' AND NOT r.delivery THEN jsonb_build_array(jsonb_build_object(
                'at_ms', t.now, 'event', 'released',
                'reason', 'lease expired; route policy: release'))
            WHEN $2 = 'parked' THEN jsonb_build_array(
                jsonb_build_object('at_ms', t.now, 'event', 'unknown', 'reason', 'lease_expired'),
                jsonb_build_object('at_ms', t.now, 'event', 'parked', 'reason', 'route policy: park'))
            ELSE jsonb_build_array(
                jsonb_build_object('at_ms', t.now, 'event', 'unknown', 'reason', 'lease_expired'))
        END
    FROM t
    WHERE r.prefix = @prefix AND r.digest = $1 AND r.state = 'in_flight'
        AND r.lease_until_ms <= t.now
    RETURNING t.now, @record(r), r.waiting
),
told AS (SELECT pg_notify(@channel, $1) FROM moved m WHERE m.waiting)
SELECT m.*, (SELECT count(*) FROM told) AS notified FROM moved m
