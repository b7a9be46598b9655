-- gateway_records as a rowid table, its rows in the order they arrived: a claim
-- appends its row at the table's end, and the completion that follows it rewrites a
-- page that recent claims share, where a table keyed by the digest (a hash, so a
-- random place) wrote a page of its own for each. The digest stays the records' key,
-- through a unique index of its own (an entry far smaller than a row).
CREATE TABLE gateway_records_by_arrival (
    digest          TEXT NOT NULL UNIQUE,
    route           TEXT NOT NULL,
    key             TEXT NOT NULL,
    state           TEXT NOT NULL,
    run_id          TEXT NOT NULL,
    fingerprint     TEXT NOT NULL,
    created_ms      INTEGER NOT NULL,
    since_ms        INTEGER NOT NULL,
    lease_until_ms  INTEGER NOT NULL DEFAULT 0,
    reason          TEXT NOT NULL DEFAULT '',
    holder          TEXT NOT NULL DEFAULT '',
    holder_since_ms INTEGER NOT NULL DEFAULT 0,
    check_lock_ms   INTEGER NOT NULL DEFAULT 0,
    last_check_ms   INTEGER NOT NULL DEFAULT 0,
    reconcile       TEXT NOT NULL DEFAULT '{}',
    history         TEXT NOT NULL DEFAULT '[]',
    delivery        INTEGER NOT NULL DEFAULT 0,
    attempts        INTEGER NOT NULL DEFAULT 0,
    due_ms          INTEGER NOT NULL DEFAULT 0,
    last_attempt    TEXT NOT NULL DEFAULT '{}',
    place           INTEGER,
    expires_ms      INTEGER,
    response        BLOB,
    request         BLOB,
    token           BLOB
);

INSERT INTO gateway_records_by_arrival (
    digest, route, key, state, run_id, fingerprint, created_ms, since_ms, lease_until_ms,
    reason, holder, holder_since_ms, check_lock_ms, last_check_ms, reconcile, history,
    delivery, attempts, due_ms, last_attempt, place, expires_ms, response, request, token
)
SELECT
    digest, route, key, state, run_id, fingerprint, created_ms, since_ms, lease_until_ms,
    reason, holder, holder_since_ms, check_lock_ms, last_check_ms, reconcile, history,
    delivery, attempts, due_ms, last_attempt, place, expires_ms, response, request, token
FROM gateway_records ORDER BY created_ms, digest;

DROP TABLE gateway_records;

ALTER TABLE gateway_records_by_arrival RENAME TO gateway_records;

-- The indexes of 001_initial.sql, on the new table.
CREATE INDEX gateway_records_listed ON gateway_records (state, route, place, digest)
    WHERE place IS NOT NULL;
CREATE INDEX gateway_records_due ON gateway_records (route, due_ms, digest)
    WHERE state IN ('queued', 'retrying');
CREATE INDEX gateway_records_expiry ON gateway_records (expires_ms)
    WHERE expires_ms IS NOT NULL;
