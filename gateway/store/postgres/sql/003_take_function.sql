-- Schema version 3: the claim and the accept as one server-side function, gateway_take
-- (the PostgreSQL twin of lua/claim.lua and lua/accept.lua: one round trip, decided
-- in the database). It reads first and writes only when the key is free, so a replay
-- is a plain read: no row locked, no index opened for writing, no transaction id, no
-- WAL, no commit to wait for. As one INSERT ... ON CONFLICT statement (version 1's
-- claim.sql) a replay cost the database twice a plain SELECT: a data-modifying
-- statement opens every index of the table and locks the row whatever it finds.
--
-- Under READ COMMITTED each statement below takes a new snapshot, which is what makes
-- the read-then-write safe: a key that the read saw free (or absent) is taken only by
-- the INSERT ... ON CONFLICT DO UPDATE ... WHERE free, which waits for a concurrent
-- claim of the same key to commit and then re-checks "free" on the row that claim
-- wrote. Losing that race returns no row from the INSERT; the loop reads again, in a
-- new snapshot that has the winner's row, and answers with it. Two sessions claiming
-- one new key: exactly one wins.
--
-- p_delivery: an accept (lua/accept.lua): the key is queued, not in flight, its
-- request and token stored, and `!d` NOTIFYed on p_channel; with p_admit false a free
-- key is left as it is (the queue is full) and nothing is returned. A claim (not a
-- delivery) that finds the key in flight marks it `waiting`, so its change is NOTIFYed.
--
-- Returns (outcome, at_ms, rec): outcome 1 taken by p_run_id (rec NULL: the caller
-- knows what it wrote), 0 the record found (rec, its fields at their defaults NULL).
-- Whether a key's record leaves the key free for a new run at now_ms: a released
-- tombstone, a settled row past its expiry (absent), or an in-flight row whose lease
-- ran out on a route whose policy is release (not a delivery: its caller got 202 and
-- will not send it again). gateway_take asks it twice: of the row its read saw, and,
-- in the conflict's WHERE, of the row as it is when the write locks it.
CREATE FUNCTION gateway_free(state text, expires_ms bigint, lease_until_ms bigint,
                             delivery boolean, now_ms bigint, policy text)
RETURNS boolean LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(expires_ms <= now_ms, false) OR state = 'released'
        OR (state = 'in_flight' AND lease_until_ms <= now_ms AND policy = 'release'
            AND NOT delivery)
$$;

CREATE FUNCTION gateway_take(
    p_prefix text, p_digest text, p_route text, p_key text, p_run_id text,
    p_fingerprint text, p_policy text, p_lease_ms bigint, p_delivery boolean,
    p_admit boolean, p_token bytea, p_request bytea, p_channel text, p_origin text
) RETURNS TABLE (outcome integer, at_ms bigint, rec gateway_records)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    t bigint;
    cur gateway_records;
BEGIN
    -- Each turn is decided on a snapshot newer than the last one's write, so the
    -- second turn always finds the row that beat this one; the third is a margin.
    FOR turn IN 1..3 LOOP
        t := gateway_now_ms();
        SELECT * INTO cur FROM gateway_records r
        WHERE r.prefix = p_prefix AND r.digest = p_digest;
        IF FOUND AND NOT gateway_free(cur.state, cur.expires_ms, cur.lease_until_ms,
                                      cur.delivery, t, p_policy) THEN
            -- Taken: a replay, or a duplicate of a run in flight.
            IF NOT p_delivery AND cur.state = 'in_flight' AND cur.lease_until_ms > t
                    AND NOT cur.waiting THEN
                UPDATE gateway_records r SET waiting = true
                WHERE r.prefix = p_prefix AND r.digest = p_digest AND r.state = 'in_flight'
                    AND r.lease_until_ms > t AND NOT r.waiting
                RETURNING * INTO cur;
                CONTINUE WHEN NOT FOUND;  -- it moved meanwhile: read it again
            END IF;
            -- What is at its default goes as NULL, which the driver need not decode
            -- (decode_record reads NULL as the default): most records, replays among
            -- them, have no history, no check, no operator and no attempt yet.
            cur.history := nullif(cur.history, '[]');
            cur.reconcile := nullif(cur.reconcile, '{}');
            cur.last_attempt := nullif(cur.last_attempt, '{}');
            cur.reason := nullif(cur.reason, '');
            cur.holder := nullif(cur.holder, '');
            cur.holder_since_ms := nullif(cur.holder_since_ms, 0);
            cur.check_lock_ms := nullif(cur.check_lock_ms, 0);
            cur.last_check_ms := nullif(cur.last_check_ms, 0);
            RETURN QUERY SELECT 0, t, cur;
            RETURN;
        END IF;
        IF p_delivery AND NOT p_admit THEN
            RETURN;  -- free, and the queue is full: nothing stored
        END IF;
        INSERT INTO gateway_records AS r (prefix, digest, route, key, state, run_id,
            fingerprint, created_ms, since_ms, lease_until_ms, delivery, due_ms, token,
            request)
        VALUES (p_prefix, p_digest, p_route, p_key,
            CASE WHEN p_delivery THEN 'queued' ELSE 'in_flight' END, p_run_id, p_fingerprint,
            t, t, CASE WHEN p_delivery THEN 0 ELSE t + p_lease_ms END, p_delivery,
            CASE WHEN p_delivery THEN t ELSE 0 END, p_token, p_request)
        -- The one list of what a new run of a key starts from (the columns not set
        -- here have their defaults on a new row).
        ON CONFLICT (prefix, digest) DO UPDATE SET
            route = excluded.route, key = excluded.key, state = excluded.state,
            run_id = excluded.run_id, fingerprint = excluded.fingerprint,
            created_ms = excluded.created_ms, since_ms = excluded.since_ms,
            lease_until_ms = excluded.lease_until_ms, expires_ms = NULL, response = NULL,
            reason = '', holder = '', holder_since_ms = 0, check_lock_ms = 0,
            check_token = '', last_check_ms = 0, reconcile = '{}', waiting = false,
            delivery = excluded.delivery, attempts = 0, due_ms = excluded.due_ms,
            last_attempt = '{}', token = excluded.token, request = excluded.request,
            history = CASE
                WHEN r.expires_ms <= excluded.created_ms THEN '[]'  -- gone: nothing to carry
                WHEN r.state = 'in_flight' THEN r.history || jsonb_build_array(
                    jsonb_build_object('at_ms', excluded.created_ms, 'event', 'released',
                        'reason', 'lease expired; route policy: release'))
                ELSE r.history
            END
        -- Free on the row as it is now, not as the read saw it: a claim that committed
        -- after the read's snapshot has taken the key.
        WHERE gateway_free(r.state, r.expires_ms, r.lease_until_ms, r.delivery, t, p_policy)
        RETURNING * INTO cur;
        IF FOUND THEN
            IF p_delivery THEN
                PERFORM pg_notify(p_channel, '!d ' || p_digest || '/' || p_route || ' '
                    || t || ' ' || t || ' ' || p_origin);
            END IF;
            RETURN QUERY SELECT 1, t, NULL::gateway_records;  -- the caller knows it
            RETURN;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'gateway_take: the record of % changed under three reads', p_digest;
END
$$;
