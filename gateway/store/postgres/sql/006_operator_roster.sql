-- Schema version 6: the operator roster (gateway/store/operator_roster.py): per entry
-- (an operator's way of signing in to the console), the mark of the credential behind
-- it and the time from which its console sessions are valid. (Version 5 is the counts'
-- migration; the numbers only need to grow.)
CREATE TABLE gateway_roster (
    prefix text NOT NULL,
    entry text NOT NULL,
    mark text NOT NULL,
    -- gateway_now_ms() when the entry joined or its mark changed, or later (below)
    since_ms bigint NOT NULL,
    PRIMARY KEY (prefix, entry)
);
-- One row per prefix: the last time given out, so the next is later whatever the clock
-- does; a recording locks it first, so two at once are applied one after the other.
CREATE TABLE gateway_roster_times (
    prefix text PRIMARY KEY,
    last_ms bigint NOT NULL
);
