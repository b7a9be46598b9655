-- The PostgreSQL store's schema, version 2: each route's last success, for
-- Store.last_successes (the overview's figure, the same on every replica).
-- complete.sql writes it in the completion's own statement: one round trip.
CREATE TABLE gateway_successes (
    prefix text NOT NULL,
    route text NOT NULL,
    -- the last completion with a status below 500, in gateway_now_ms(); kept to the
    -- second (complete.sql), so a route's row is written at most once a second
    at_ms bigint NOT NULL,
    PRIMARY KEY (prefix, route)
);
