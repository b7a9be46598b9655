-- A record, read with the database's clock; a settled one past its expiry is absent.
-- $1 digest. Returns (now, record), or no row.
SELECT t.now, @record(r)
FROM gateway_records r, (SELECT gateway_now_ms() AS now) t
WHERE r.prefix = @prefix AND r.digest = $1 AND (r.expires_ms IS NULL OR r.expires_ms > t.now)
