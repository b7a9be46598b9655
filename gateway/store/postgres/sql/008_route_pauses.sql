-- Schema version 8: the async routes' pauses (gateway/store/route_pauses.py): per
-- route, its consecutive refused attempts and whether, since when, by whom and why it
-- is paused, and when an automatic pause's next probe may go out. A move locks the
-- route's row (SELECT ... FOR UPDATE), so moves at once are applied one after the other.
CREATE TABLE gateway_route_pauses (
    prefix text NOT NULL,
    route text NOT NULL,
    failures integer NOT NULL DEFAULT 0,
    since_ms bigint NOT NULL DEFAULT 0,
    by_whom text NOT NULL DEFAULT '',
    why text NOT NULL DEFAULT '',
    probe_ms bigint NOT NULL DEFAULT 0,
    changed_ms bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (prefix, route)
);
