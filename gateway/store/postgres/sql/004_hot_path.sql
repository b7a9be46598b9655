-- Schema version 4: a first request's two statements made cheaper for the database.
--
-- 1. gateway_take gains p_fresh: a route whose keys are mostly new (a cron job's run,
--    an invoice per customer) is inserted first, with `INSERT ... ON CONFLICT DO
--    NOTHING`, which costs a new key a third less of the database's CPU than reading
--    first and then inserting; a route whose keys are mostly repeats (a webhook sender
--    retrying) reads first, which costs a replay a quarter less than a conflicting
--    insert. Which one a route gets is the gateway's guess from the route's last claim
--    (gateway/store/postgres/store.py); both orders decide the same way, only the cost
--    differs. DO NOTHING never locks an existing row (no transaction id, nothing to
--    commit), and it waits for a concurrent insert of the key to commit or roll back,
--    so after a conflict the row is there for the next read to see.
-- 2. A free row that exists (a released tombstone, a settled row past its expiry, an
--    in-flight row whose lease ran out on a release route) is taken by an UPDATE whose
--    WHERE asks gateway_free again of the row as it is when the UPDATE locks it: a
--    claim that committed after this one's read has taken the key, and the loser reads
--    again and answers with the winner's record.
-- 3. The completion is a function, gateway_complete (it was complete.sql's five CTEs):
--    one UPDATE, then only what that UPDATE calls for. The route's last success is
--    written only when the gateway asks (it asks once a second per route and process:
--    see PostgresStore.complete), and then only if the row is a second old.
--
-- Measured with pgbench (32 clients, synchronous_commit on, the database's CPU from
-- /proc; docs/performance.md, "The PostgreSQL store"): claim + completion of a new key 367-409 us
-- with version 3, 247-276 us with these; a replay's claim 51-52 us read first, 71-72
-- inserted first.

DROP FUNCTION gateway_take(text, text, text, text, text, text, text, bigint, boolean,
                           boolean, bytea, bytea, text, text);

-- Returns (outcome, at_ms, rec): outcome 1 taken by p_run_id (rec NULL: the caller
-- knows what it wrote), 0 the record found (rec, its fields at their defaults NULL).
-- p_delivery: an accept (lua/accept.lua): the key is queued, not in flight, its
-- request and token stored, and `!d` NOTIFYed on p_channel; with p_admit false a free
-- key is left as it is (the queue is full) and nothing is returned. A claim (not a
-- delivery) that finds the key in flight marks it `waiting`, so its change is NOTIFYed.
CREATE FUNCTION gateway_take(
    p_prefix text, p_digest text, p_route text, p_key text, p_run_id text,
    p_fingerprint text, p_policy text, p_lease_ms bigint, p_delivery boolean,
    p_admit boolean, p_token bytea, p_request bytea, p_channel text, p_origin text,
    p_fresh boolean
) RETURNS TABLE (outcome integer, at_ms bigint, rec gateway_records)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    t bigint;
    cur gateway_records;
    taken boolean := false;
BEGIN
    -- Under READ COMMITTED each statement below takes a new snapshot, so each turn is
    -- decided on a snapshot newer than the last one's write: the second turn finds the
    -- row that beat the first (or its absence, if the reaper deleted it). A turn is lost
    -- only to another session's write; schema 4 loses more than schema 3 did (an
    -- insert-first turn that meets a free row, a free row the reaper deletes before the
    -- UPDATE), seen under a stress of 1 ms TTLs with the reaper running, so the margin
    -- is wide.
    FOR turn IN 1..12 LOOP
        t := gateway_now_ms();
        -- Insert first only where an insert may follow: an accept that may not admit
        -- reads (a taken key is "exists", a free one "full").
        IF turn > 1 OR NOT p_fresh OR (p_delivery AND NOT p_admit) THEN
            SELECT * INTO cur FROM gateway_records r
            WHERE r.prefix = p_prefix AND r.digest = p_digest;
            IF FOUND AND NOT gateway_free(cur.state, cur.expires_ms, cur.lease_until_ms,
                                          cur.delivery, t, p_policy) THEN
                -- Taken: a replay, or a duplicate of a run in flight.
                IF NOT p_delivery AND cur.state = 'in_flight' AND cur.lease_until_ms > t
                        AND NOT cur.waiting THEN
                    UPDATE gateway_records r SET waiting = true
                    WHERE r.prefix = p_prefix AND r.digest = p_digest
                        AND r.state = 'in_flight' AND r.lease_until_ms > t AND NOT r.waiting
                    RETURNING * INTO cur;
                    CONTINUE WHEN NOT FOUND;  -- it moved meanwhile: read it again
                END IF;
                -- What is at its default goes as NULL, which the driver need not decode
                -- (decode_record reads NULL as the default): most records, replays
                -- among them, have no history, no check, no operator and no attempt.
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
            IF FOUND THEN
                -- A free row: a new run of the key starts from it. The one list of
                -- what a new run resets (a new row has these at their defaults).
                UPDATE gateway_records r SET
                    route = p_route, key = p_key,
                    state = CASE WHEN p_delivery THEN 'queued' ELSE 'in_flight' END,
                    run_id = p_run_id, fingerprint = p_fingerprint, created_ms = t,
                    since_ms = t,
                    lease_until_ms = CASE WHEN p_delivery THEN 0 ELSE t + p_lease_ms END,
                    expires_ms = NULL, response = NULL, reason = '', holder = '',
                    holder_since_ms = 0, check_lock_ms = 0, check_token = '',
                    last_check_ms = 0, reconcile = '{}', waiting = false,
                    delivery = p_delivery, attempts = 0,
                    due_ms = CASE WHEN p_delivery THEN t ELSE 0 END, last_attempt = '{}',
                    token = p_token, request = p_request,
                    history = CASE
                        WHEN r.expires_ms <= t THEN '[]'  -- gone: nothing to carry
                        WHEN r.state = 'in_flight' THEN r.history || jsonb_build_array(
                            jsonb_build_object('at_ms', t, 'event', 'released',
                                'reason', 'lease expired; route policy: release'))
                        ELSE r.history
                    END
                WHERE r.prefix = p_prefix AND r.digest = p_digest
                    -- Free on the row as it is now, not as the read saw it: a claim that
                    -- committed after the read's snapshot has taken the key.
                    AND gateway_free(r.state, r.expires_ms, r.lease_until_ms, r.delivery,
                                     t, p_policy);
                taken := FOUND;
                EXIT WHEN taken;
                CONTINUE;  -- taken by another claim, or deleted by the reaper: read again
            END IF;
        END IF;
        IF p_delivery AND NOT p_admit THEN
            RETURN;  -- free (no row), and the queue is full: nothing stored
        END IF;
        INSERT INTO gateway_records (prefix, digest, route, key, state, run_id,
            fingerprint, created_ms, since_ms, lease_until_ms, delivery, due_ms, token,
            request)
        VALUES (p_prefix, p_digest, p_route, p_key,
            CASE WHEN p_delivery THEN 'queued' ELSE 'in_flight' END, p_run_id, p_fingerprint,
            t, t, CASE WHEN p_delivery THEN 0 ELSE t + p_lease_ms END, p_delivery,
            CASE WHEN p_delivery THEN t ELSE 0 END, p_token, p_request)
        ON CONFLICT (prefix, digest) DO NOTHING;
        taken := FOUND;
        -- Not taken: the key has a row (a concurrent claim's, committed: DO NOTHING
        -- waited for it); the next turn reads it.
        EXIT WHEN taken;
    END LOOP;
    IF NOT taken THEN
        RAISE EXCEPTION 'gateway_take: the record of % changed under twelve reads', p_digest;
    END IF;
    IF p_delivery THEN
        PERFORM pg_notify(p_channel, '!d ' || p_digest || '/' || p_route || ' '
            || t || ' ' || t || ' ' || p_origin);
    END IF;
    RETURN QUERY SELECT 1, t, NULL::gateway_records;  -- the caller knows what it wrote
END
$$;

-- Store the response of the run that owns the key, in flight or unresolved (a late
-- answer is still the answer). p_attempt: the delivery's attempt (JSON) or NULL;
-- p_success: write the route's last success (the gateway asks at most once a second
-- per route; the row is written only if it is a second old, so completions do not
-- queue on its lock). Returns ok: the record is, now, completed by this run (a retried
-- completion is success, not a second write). A waiter's notice carries the
-- fingerprint and response when they fit in NOTIFY's payload, so a duplicate in
-- another process replays without a re-read.
CREATE FUNCTION gateway_complete(
    p_prefix text, p_digest text, p_run_id text, p_response bytea, p_ttl_ms bigint,
    p_origin text, p_attempt jsonb, p_success boolean, p_channel text
) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    t bigint := gateway_now_ms();
    was_waited boolean;
    print text;
    done_route text;
BEGIN
    UPDATE gateway_records r SET state = 'completed', since_ms = t, response = p_response,
        expires_ms = t + p_ttl_ms, lease_until_ms = 0, check_lock_ms = 0, holder = '',
        holder_since_ms = 0, reason = '', request = NULL,
        last_attempt = CASE WHEN r.delivery AND p_attempt IS NOT NULL THEN p_attempt
                            ELSE r.last_attempt END,
        history = CASE WHEN r.state = 'unresolved' OR r.history <> '[]'
            THEN r.history || jsonb_build_array(jsonb_build_object(
                'at_ms', t, 'event', 'completed', 'origin', p_origin))
            ELSE r.history END
    WHERE r.prefix = p_prefix AND r.digest = p_digest AND r.run_id = p_run_id
        AND r.state IN ('in_flight', 'unresolved')
    RETURNING r.waiting, r.fingerprint, r.route INTO was_waited, print, done_route;
    IF NOT FOUND THEN
        -- Already completed by this run (a retry of this call), or not this run's.
        RETURN EXISTS (SELECT 1 FROM gateway_records r
            WHERE r.prefix = p_prefix AND r.digest = p_digest AND r.run_id = p_run_id
                AND r.state = 'completed' AND r.expires_ms > t);
    END IF;
    IF p_success THEN
        -- An UPDATE locks only the rows it changes: within a second of the last write
        -- it skips the row instead of queueing on its lock.
        UPDATE gateway_successes s SET at_ms = t
        WHERE s.prefix = p_prefix AND s.route = done_route AND s.at_ms < t - 1000;
        IF NOT FOUND THEN
            INSERT INTO gateway_successes (prefix, route, at_ms)
            VALUES (p_prefix, done_route, t)
            ON CONFLICT DO NOTHING;  -- the route's first success (or a recent one)
        END IF;
    END IF;
    IF was_waited THEN
        PERFORM pg_notify(p_channel, p_digest || CASE WHEN length(p_response) <= 5000
            THEN E'\n' || print || E'\n' || encode(p_response, 'base64') ELSE '' END);
    END IF;
    RETURN true;
END
$$;
