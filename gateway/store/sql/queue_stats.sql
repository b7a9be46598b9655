-- Per route with pending deliveries: queued and retrying counts and the earliest due
-- time, from the due index (O(pending), never the settled records). Returns (now,
-- route, queued, retrying, earliest_due_ms) rows.
SELECT t.now, r.route, count(*) FILTER (WHERE r.state = 'queued') AS queued,
    count(*) FILTER (WHERE r.state = 'retrying') AS retrying, min(r.due_ms) AS earliest
FROM gateway_records r, (SELECT gateway_now_ms() AS now) t
WHERE r.prefix = @prefix AND r.state IN ('queued', 'retrying')
GROUP BY t.now, r.route ORDER BY r.route
