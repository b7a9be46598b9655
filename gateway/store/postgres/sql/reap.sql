-- The reaper: delete up to $1 settled records past their expiry, of every prefix, one
-- gateway at a time ($2: the advisory lock's key, held until this statement's
-- transaction ends; a replica that does not get it skips the round). Only completed and
-- released records ever expire: unresolved, parked, claimed, in-flight, queued and
-- retrying ones are never deleted here. Returns (got the lock, rows deleted).
WITH t AS (SELECT gateway_now_ms() AS now, pg_try_advisory_xact_lock($2) AS got),
doomed AS (
    SELECT r.prefix, r.digest FROM gateway_records r
    WHERE (SELECT got FROM t)
        AND r.state IN ('completed', 'released') AND r.expires_ms <= (SELECT now FROM t)
    ORDER BY r.expires_ms LIMIT $1
    FOR UPDATE OF r SKIP LOCKED
),
gone AS (
    DELETE FROM gateway_records r USING doomed d
    WHERE r.prefix = d.prefix AND r.digest = d.digest
    RETURNING 1
)
SELECT (SELECT got FROM t) AS got, (SELECT count(*) FROM gone) AS deleted
