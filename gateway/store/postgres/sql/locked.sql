-- A record and the database's now, locked until the transaction ends: the first step
-- of the operations that decide in Python (end_check, the operators' moves), whose
-- write (write() in store.py) is conditional on the state read here. $1 digest.
SELECT t.now, @record(r), r.waiting
FROM gateway_records r, (SELECT gateway_now_ms() AS now) t
WHERE r.prefix = @prefix AND r.digest = $1 AND (r.expires_ms IS NULL OR r.expires_ms > t.now)
FOR UPDATE OF r
