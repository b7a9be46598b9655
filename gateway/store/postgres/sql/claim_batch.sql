-- Claim many keys in one statement, one round trip and one commit: claim.sql once per
-- entry, for the calls that queued for a connection together (postgres/batch.py). $1
-- .. $8 are claim.sql's parameters as arrays, one element per entry, sorted by digest
-- (the order every batch takes its row locks in). The LATERAL join runs gateway_take
-- per entry in the arrays' order, and each call sees the earlier entries' rows (the
-- function is VOLATILE): the same key twice decides as two statements would. Returns
-- (i, outcome, now, record) per entry, i its 1-based position in the arrays.
SELECT b.i, c.outcome, c.at_ms AS now, @record((c.rec))
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[],
            $7::text[], $8::boolean[])
    WITH ORDINALITY AS b(digest, route, key, run_id, fingerprint, lease_ms, policy, fresh, i)
CROSS JOIN LATERAL gateway_take(@prefix, b.digest, b.route, b.key, b.run_id,
    b.fingerprint, b.policy, b.lease_ms, false, NULL, NULL, NULL, '', '', b.fresh) c
