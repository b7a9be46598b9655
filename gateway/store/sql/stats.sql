-- The gauges: count and oldest age per route of unresolved, parked and claimed records,
-- from the open index (O(open records), never the completed ones). Returns (route,
-- state, count, oldest_ms) rows.
SELECT r.route, r.state, count(*) AS count, max(t.now - r.since_ms) AS oldest_ms
FROM gateway_records r, (SELECT gateway_now_ms() AS now) t
WHERE r.prefix = @prefix AND r.state IN ('unresolved', 'parked', 'claimed')
GROUP BY r.route, r.state ORDER BY r.route, r.state
