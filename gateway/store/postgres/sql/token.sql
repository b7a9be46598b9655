-- A delivery's status token, and nothing else of its record: the response and the
-- request stay where they are (TOASTed out of line when large). $1 digest. Returns
-- (token), or no row for no record, one past its expiry, or one that is no delivery.
SELECT r.token
FROM gateway_records r
WHERE r.prefix = @prefix AND r.digest = $1 AND r.delivery
    AND (r.expires_ms IS NULL OR r.expires_ms > gateway_now_ms())
