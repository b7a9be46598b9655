-- Claim a free key for a run, or read what is there: one round trip (lua/claim.lua's
-- twin), decided by gateway_take (005_counts.sql): a write only when the key is
-- free, an insert first when the route's keys are mostly new, else a read first. Free:
-- no row, a released tombstone (its history carried on), a settled row past its expiry
-- (absent), or an in-flight row whose lease ran out on a route whose policy is release
-- (not a delivery: its caller got 202 and will not send it again). $1 digest, $2 route,
-- $3 key, $4 run_id, $5 fingerprint, $6 lease_ms, $7 expired-lease policy, $8 fresh
-- (insert first). Returns (outcome, now, record): outcome 1 claimed by $4; 0 the
-- record as found, marked `waiting` when in flight (its changes are then NOTIFYed).
SELECT c.outcome, c.at_ms AS now, @record((c.rec))
FROM gateway_take(@prefix, $1, $2, $3, $4, $5, $7, $6, false, NULL, NULL, NULL, '', '', $8) c
