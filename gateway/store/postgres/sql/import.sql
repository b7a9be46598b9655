-- A copied record, written as it is (Store.import_records): no move, no notice; the
-- triggers of 005_counts.sql keep its count. A row past its expiry is taken over; a
-- live one is kept and nothing is returned. $1 digest, $2 route, $3 key, $4 state,
-- $5 run_id, $6 fingerprint, $7 created_ms, $8 since_ms, $9 lease_until_ms, $10 the ms
-- it has left (NULL: it never expires), $11 response, $12 reason, $13 holder,
-- $14 holder_since_ms, $15 check_lock_ms, $16 last_check_ms, $17 reconcile,
-- $18 history, $19 delivery, $20 attempts, $21 due_ms, $22 last_attempt, $23 token,
-- $24 request. Returns one row when written.
INSERT INTO gateway_records AS r (prefix, digest, route, key, state, run_id, fingerprint,
    created_ms, since_ms, lease_until_ms, expires_ms, response, reason, holder,
    holder_since_ms, check_lock_ms, last_check_ms, reconcile, history, delivery, attempts,
    due_ms, last_attempt, token, request)
VALUES (@prefix, $1, $2, $3, $4, $5, $6, $7, $8, $9, gateway_now_ms() + $10, $11, $12, $13,
    $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24)
ON CONFLICT (prefix, digest) DO UPDATE SET
    route = excluded.route, key = excluded.key, state = excluded.state,
    run_id = excluded.run_id, fingerprint = excluded.fingerprint,
    created_ms = excluded.created_ms, since_ms = excluded.since_ms,
    lease_until_ms = excluded.lease_until_ms, expires_ms = excluded.expires_ms,
    response = excluded.response, reason = excluded.reason, holder = excluded.holder,
    holder_since_ms = excluded.holder_since_ms, check_lock_ms = excluded.check_lock_ms,
    check_token = '', last_check_ms = excluded.last_check_ms,
    reconcile = excluded.reconcile, history = excluded.history, waiting = false,
    delivery = excluded.delivery, attempts = excluded.attempts, due_ms = excluded.due_ms,
    last_attempt = excluded.last_attempt, token = excluded.token, request = excluded.request
WHERE r.expires_ms <= gateway_now_ms()
RETURNING 1
