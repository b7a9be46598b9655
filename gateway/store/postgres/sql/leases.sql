-- The sweep's work list: in-flight records whose lease ran out, from the lease index.
-- $1 limit. Returns (digest, route) rows, the longest dead first.
SELECT r.digest, r.route FROM gateway_records r
WHERE r.prefix = @prefix AND r.state = 'in_flight'
    AND r.lease_until_ms <= (SELECT gateway_now_ms())
ORDER BY r.lease_until_ms LIMIT $1
