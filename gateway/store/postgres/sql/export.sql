-- A page of a copy's walk (Store.export_records): the live records after a digest, in
-- digest order (the primary key's), with the stored request and the time a settled
-- one has left. $1 the last digest of the page before ('' to start), $2 the page's size.
-- Returns (now, digest, request, expires_ms, record) rows.
SELECT t.now, r.digest, r.request, r.expires_ms, @record(r)
FROM gateway_records r, (SELECT gateway_now_ms() AS now) t
WHERE r.prefix = @prefix AND r.digest > $1 AND (r.expires_ms IS NULL OR r.expires_ms > t.now)
ORDER BY r.digest
LIMIT $2
