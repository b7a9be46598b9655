-- The rescan for lost notices: up to $2 queued and retrying deliveries of route $1,
-- earliest due first, from the due index. Returns (now, digest, key, due_ms) rows; one
-- row with digest NULL when there are none (now is always read).
SELECT t.now, q.digest, q.key, q.due_ms
FROM (SELECT gateway_now_ms() AS now) t LEFT JOIN LATERAL (
    SELECT r.digest, r.key, r.due_ms FROM gateway_records r
    WHERE r.prefix = @prefix AND r.route = $1 AND r.state IN ('queued', 'retrying')
    ORDER BY r.due_ms, r.digest LIMIT $2
) q ON true
ORDER BY q.due_ms, q.digest
