-- Per route with pending deliveries: queued and retrying counts (gateway_counts, summed
-- over its shards) and the earliest due time (one probe of the due index per route):
-- O(routes), never O(pending). Returns (now, route, queued, retrying, earliest_due_ms).
SELECT t.now, c.route, c.queued, c.retrying, (
        SELECT r.due_ms FROM gateway_records r
        WHERE r.prefix = @prefix AND r.route = c.route
            AND r.state IN ('queued', 'retrying')
        ORDER BY r.due_ms LIMIT 1) AS earliest
FROM (SELECT g.route, coalesce(sum(g.n) FILTER (WHERE g.state = 'queued'), 0)::bigint AS queued,
             coalesce(sum(g.n) FILTER (WHERE g.state = 'retrying'), 0)::bigint
                 AS retrying
      FROM gateway_counts g
      WHERE g.prefix = @prefix AND g.state IN ('queued', 'retrying')
      GROUP BY g.route HAVING sum(g.n) > 0) c,
    (SELECT gateway_now_ms() AS now) t
ORDER BY c.route
