-- Whether this prefix holds any live record (a copy's destination must hold none).
SELECT EXISTS (
    SELECT 1 FROM gateway_records r
    WHERE r.prefix = @prefix AND (r.expires_ms IS NULL OR r.expires_ms > gateway_now_ms())
) AS held
