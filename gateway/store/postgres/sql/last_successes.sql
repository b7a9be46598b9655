-- Per route, milliseconds since its last success by the database's clock (complete.sql
-- writes it). Returns (route, age_ms) rows: one per route that had one.
SELECT s.route, greatest(0, t.now - s.at_ms) AS age_ms
FROM gateway_successes s, (SELECT gateway_now_ms() AS now) t
WHERE s.prefix = @prefix
