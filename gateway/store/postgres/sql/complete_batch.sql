-- Store many responses in one statement, one round trip and one commit: complete.sql
-- once per entry, for the completions that queued for a connection together
-- (postgres/batch.py). $1 .. $6 are complete.sql's first six parameters as arrays,
-- sorted by digest (the lock order), the attempt as JSON text; the route's last success
-- is never written here (a completion that asks for it runs alone: a second lock).
-- Returns (i, ok) per entry, i its 1-based position in the arrays.
SELECT b.i, gateway_complete(@prefix, b.digest, b.run_id, b.response, b.ttl_ms, b.origin,
    b.attempt::jsonb, false, @channel) AS ok
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bigint[], $5::text[], $6::text[])
    WITH ORDINALITY AS b(digest, run_id, response, ttl_ms, origin, attempt, i)
