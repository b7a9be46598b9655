-- Queue a delivery on a free key, or read what is there: one round trip, a delivery's
-- claim (lua/accept.lua's twin; free as in claim.sql, decided by the same function).
-- $1 digest, $2 route, $3 key, $4 run_id, $5 fingerprint, $6 request (sealed), $7
-- token (sealed), $8 limit (the route's delivery.max_queued, NULL none: see
-- gateway_take, 005_counts.sql), $9 expired-lease policy, $10 origin, $11 delay (ms
-- after now: when the first attempt is due, 007_delayed_delivery.sql), $12 fresh
-- (insert first, as in claim.sql). Returns (outcome, now, record): 1 queued (and NOTIFYed
-- `!d`), 0 the record found (not released, not past its expiry). No row: the key was
-- free and $8 of the route's deliveries wait ("full": nothing stored).
SELECT c.outcome, c.at_ms AS now, @record((c.rec))
FROM gateway_take(@prefix, $1, $2, $3, $4, $5, $9, 0, true, $8, $7, $6, @channel, $10, $12,
                 $11) c
