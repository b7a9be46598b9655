-- Schema version 7: an accept may queue a delivery due later than now (a route's
-- delivery.delay, or the caller's delay or not-before header): gateway_take takes
-- p_delay_ms, the milliseconds after the store's now when the first attempt is due
-- (0 by default: a claim, and an accept due at once). The due time is the row's
-- due_ms, the due index's order, so a delay outlasts any restart as a retry's does.

DROP FUNCTION gateway_take(text, text, text, text, text, text, text, bigint, boolean,
                           bigint, bytea, bytea, text, text, boolean);

-- Returns (outcome, at_ms, rec): outcome 1 taken by p_run_id (rec NULL: the caller
-- knows what it wrote), 0 the record found (rec, its fields at their defaults NULL).
-- p_delivery: an accept (lua/accept.lua): the key is queued, not in flight, due
-- p_delay_ms after the store's now, its request and token stored, and `!d` NOTIFYed
-- on p_channel; with p_limit, a free key
-- is queued only while fewer than p_limit of the route's deliveries wait, else left as
-- it is and nothing is returned (the queue is full). A claim (not a delivery) that
-- finds the key in flight marks it `waiting`, so its change is NOTIFYed.
CREATE FUNCTION gateway_take(
    p_prefix text, p_digest text, p_route text, p_key text, p_run_id text,
    p_fingerprint text, p_policy text, p_lease_ms bigint, p_delivery boolean,
    p_limit bigint, p_token bytea, p_request bytea, p_channel text, p_origin text,
    p_fresh boolean, p_delay_ms bigint DEFAULT 0
) RETURNS TABLE (outcome integer, at_ms bigint, rec gateway_records)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    t bigint;
    cur gateway_records;
    taken boolean := false;
    admitted boolean := NOT p_delivery OR p_limit IS NULL;
    waiting bigint;
BEGIN
    -- Under READ COMMITTED each statement below takes a new snapshot, so each turn is
    -- decided on a snapshot newer than the last one's write: the second turn finds the
    -- row that beat the first (or its absence, if the reaper deleted it). A turn is lost
    -- only to another session's write; schema 4 loses more than schema 3 did (an
    -- insert-first turn that meets a free row, a free row the reaper deletes before the
    -- UPDATE), seen under a stress of 1 ms TTLs with the reaper running, so the margin
    -- is wide.
    FOR turn IN 1..13 LOOP
        t := gateway_now_ms();
        -- Insert first only where an insert may follow: a bounded accept reads first
        -- (a taken key is "exists" however full the queue, and only a free one waits
        -- for the route's admission).
        IF turn > 1 OR NOT p_fresh OR NOT admitted THEN
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
            IF NOT admitted THEN
                -- Free: admitted only while fewer than p_limit of the route's deliveries
                -- wait. The route's accepts take turns here until each commits, so each
                -- counts (in a snapshot taken after the lock) every one admitted before
                -- it; a pick or a retry moving a count meanwhile needs no turn (it can
                -- only lower the count, or raise it with work already accepted). A
                -- queue already full says so without waiting for a turn.
                FOR locked IN 0..1 LOOP
                    SELECT coalesce(sum(c.n), 0) INTO waiting FROM gateway_counts c
                    WHERE c.prefix = p_prefix AND c.route = p_route
                        AND c.state IN ('queued', 'retrying');
                    IF waiting >= p_limit THEN
                        RETURN;  -- free, and the queue is full: nothing stored
                    END IF;
                    EXIT WHEN locked = 1;
                    PERFORM pg_advisory_xact_lock(1768189297,
                                                  hashtext(p_prefix || '/' || p_route));
                END LOOP;
                admitted := true;
                CONTINUE;  -- read the key again, in a snapshot after the lock
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
                    due_ms = CASE WHEN p_delivery THEN t + p_delay_ms ELSE 0 END, last_attempt = '{}',
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
        INSERT INTO gateway_records (prefix, digest, route, key, state, run_id,
            fingerprint, created_ms, since_ms, lease_until_ms, delivery, due_ms, token,
            request)
        VALUES (p_prefix, p_digest, p_route, p_key,
            CASE WHEN p_delivery THEN 'queued' ELSE 'in_flight' END, p_run_id, p_fingerprint,
            t, t, CASE WHEN p_delivery THEN 0 ELSE t + p_lease_ms END, p_delivery,
            CASE WHEN p_delivery THEN t + p_delay_ms ELSE 0 END, p_token, p_request)
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
            || (t + p_delay_ms) || ' ' || t || ' ' || p_origin);
    END IF;
    RETURN QUERY SELECT 1, t, NULL::gateway_records;  -- the caller knows what it wrote
END
$$;

