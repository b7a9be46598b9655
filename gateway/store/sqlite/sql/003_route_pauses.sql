-- The async routes' pauses (gateway/store/route_pauses.py): per route, its consecutive
-- refused attempts and whether, since when, by whom and why it is paused, and when an
-- automatic pause's next probe may go out. A move is one operation under the file's
-- write lock, so moves at once are applied one after the other.
CREATE TABLE gateway_route_pauses (
    route TEXT PRIMARY KEY,
    failures INTEGER NOT NULL DEFAULT 0,
    since_ms INTEGER NOT NULL DEFAULT 0,
    by_whom TEXT NOT NULL DEFAULT '',
    why TEXT NOT NULL DEFAULT '',
    probe_ms INTEGER NOT NULL DEFAULT 0,
    changed_ms INTEGER NOT NULL DEFAULT 0
);
