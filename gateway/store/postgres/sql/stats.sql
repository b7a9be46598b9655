-- The gauges: count and oldest age per route of unresolved, parked and claimed records:
-- the counts gateway_counts keeps (summed over its shards), and each one's oldest from
-- its listing index (one probe per route and state): O(routes x states), never
-- O(records). Returns (route, state, count, oldest_ms) rows.
SELECT c.route, c.state, c.count, greatest(0, t.now - (
        SELECT min(r.since_ms) FROM gateway_records r
        WHERE r.prefix = @prefix AND r.route = c.route AND r.state = c.state
            AND r.state IN ('unresolved', 'parked', 'claimed'))) AS oldest_ms
FROM (SELECT g.route, g.state, sum(g.n)::bigint AS count FROM gateway_counts g
      WHERE g.prefix = @prefix AND g.state IN ('unresolved', 'parked', 'claimed')
      GROUP BY g.route, g.state HAVING sum(g.n) > 0) c,
    (SELECT gateway_now_ms() AS now) t
ORDER BY c.route, c.state
