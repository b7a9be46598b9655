-- The PostgreSQL store's schema, version 1 (gateway/store/postgres/schema.py applies it
-- under an advisory lock, in one transaction, and records it in gateway_schema).
-- One row per key's record, under the store's prefix; its columns are Record's
-- (gateway/records.py). Times are integer milliseconds of the database's clock
-- (gateway_now_ms), never a gateway's, as on Redis.

CREATE FUNCTION gateway_now_ms() RETURNS bigint LANGUAGE sql VOLATILE AS
$$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;

CREATE TABLE gateway_records (
    prefix text NOT NULL,
    digest text NOT NULL,
    route text NOT NULL,
    key text NOT NULL,
    state text NOT NULL CHECK (state IN ('in_flight', 'completed', 'released', 'unresolved',
                                         'parked', 'claimed', 'queued', 'retrying')),
    -- the run that owns the key (a delivery's: its latest attempt's)
    run_id text NOT NULL,
    fingerprint text NOT NULL,
    created_ms bigint NOT NULL,
    -- when it entered its current state
    since_ms bigint NOT NULL,
    -- an in_flight run's lease deadline; 0 otherwise
    lease_until_ms bigint NOT NULL DEFAULT 0,
    -- completed and released records only: when they are gone. Reads treat a row past
    -- it as absent; the reaper deletes it later, in batches.
    expires_ms bigint,
    -- StoredResponse.encode(), sealed when encryption is on (the store's codec)
    response bytea,
    reason text NOT NULL DEFAULT '',
    holder text NOT NULL DEFAULT '',
    holder_since_ms bigint NOT NULL DEFAULT 0,
    check_lock_ms bigint NOT NULL DEFAULT 0,
    -- the begin_check call holding the lock, so its retry recognises it
    check_token text NOT NULL DEFAULT '',
    last_check_ms bigint NOT NULL DEFAULT 0,
    reconcile jsonb NOT NULL DEFAULT '{}',
    -- events {at_ms, event, ...}, carried over a released tombstone's next claim
    history jsonb NOT NULL DEFAULT '[]',
    -- a claim found it in flight: its changes are NOTIFYed (most keys have no waiter)
    waiting boolean NOT NULL DEFAULT false,
    -- made by accept: a delivery, whose request is kept until it settles
    delivery boolean NOT NULL DEFAULT false,
    attempts integer NOT NULL DEFAULT 0,
    due_ms bigint NOT NULL DEFAULT 0,
    last_attempt jsonb NOT NULL DEFAULT '{}',
    -- the status URL's token and the delivery's request, sealed like the response;
    -- a large request is TOASTed out of line, so reads that do not name it never move it
    token bytea,
    request bytea,
    PRIMARY KEY (prefix, digest)
);

-- Listings, gauges and the sweep read these, never the table: O(open records).
CREATE INDEX gateway_records_open ON gateway_records (prefix, state, route, since_ms)
    WHERE state IN ('in_flight', 'unresolved', 'parked', 'claimed');
CREATE INDEX gateway_records_leases ON gateway_records (prefix, lease_until_ms)
    WHERE state = 'in_flight';
-- The delivery queue: per route, by due time (pick, due_candidates, queue_stats).
CREATE INDEX gateway_records_due ON gateway_records (prefix, route, due_ms)
    WHERE state IN ('queued', 'retrying');
-- The reaper's work list: settled records by when they are gone.
CREATE INDEX gateway_records_expiry ON gateway_records (expires_ms)
    WHERE expires_ms IS NOT NULL;

-- One marker per prefix, never deleted by the gateway: if it vanishes (or changes),
-- the records went with it (a dropped table, a restore): see Store.check_reset.
CREATE TABLE gateway_markers (
    prefix text PRIMARY KEY,
    token text NOT NULL
);
