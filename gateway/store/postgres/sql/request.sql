-- A delivery's stored request, sealed; NULL once its key settled. $1 digest.
SELECT r.request FROM gateway_records r
WHERE r.prefix = @prefix AND r.digest = $1 AND r.request IS NOT NULL
