-- The gateway's records in one SQLite file: one row per key (store/sqlite/store.py).
-- `place` is where a listed record stands in a listing (pages.place_of), NULL for a
-- settled one; `expires_ms` is a completed or released record's end (a row past it
-- reads as absent and the reaper deletes it).
CREATE TABLE gateway_records (
    digest          TEXT PRIMARY KEY,
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
) WITHOUT ROWID;

-- Listings walk (state, route) from a cursor; the counts' oldest is each pair's head.
CREATE INDEX gateway_records_listed ON gateway_records (state, route, place, digest)
    WHERE place IS NOT NULL;
-- A route's due deliveries, earliest first (pick's search, the rescan).
CREATE INDEX gateway_records_due ON gateway_records (route, due_ms, digest)
    WHERE state IN ('queued', 'retrying');
-- The reaper's batches.
CREATE INDEX gateway_records_expiry ON gateway_records (expires_ms)
    WHERE expires_ms IS NOT NULL;

-- Counted records per (route, state), kept in each move's transaction: stats,
-- queue_stats and accept's bound read these, never the records.
CREATE TABLE gateway_counts (
    route TEXT NOT NULL,
    state TEXT NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (route, state)
) WITHOUT ROWID;

CREATE TABLE gateway_last_success (
    route TEXT PRIMARY KEY,
    at_ms INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE gateway_roster (
    entry    TEXT PRIMARY KEY,
    mark     TEXT NOT NULL,
    since_ms INTEGER NOT NULL
) WITHOUT ROWID;

-- One row: the last roster time given out, so the next is later whatever the clock does.
CREATE TABLE gateway_roster_times (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    last_ms INTEGER NOT NULL
);
