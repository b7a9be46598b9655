-- Schema version 9: rate limits (Store.take_token, gateway/store/rate.py): per name, the
-- bucket's theoretical arrival time, and the function that takes a token in one call.
CREATE TABLE gateway_rates (
    prefix text NOT NULL,
    name text NOT NULL,
    -- when the next token is due at exactly the rate, in ms of the server's clock
    tat_ms double precision NOT NULL,
    PRIMARY KEY (prefix, name)
);

-- The wait in seconds until a token (0: one was taken). The row lock makes takes of
-- every process on the bucket one after the other; the clock is the server's.
CREATE FUNCTION gateway_take_token(p_prefix text, p_name text, step_ms double precision,
                                   burst integer) RETURNS double precision
LANGUAGE plpgsql AS $$
DECLARE
    now_ms double precision := extract(epoch FROM clock_timestamp()) * 1000;
    held double precision;
    start double precision;
BEGIN
    INSERT INTO gateway_rates (prefix, name, tat_ms) VALUES (p_prefix, p_name, 0)
        ON CONFLICT (prefix, name) DO NOTHING;
    SELECT tat_ms INTO held FROM gateway_rates
        WHERE prefix = p_prefix AND name = p_name FOR UPDATE;
    now_ms := extract(epoch FROM clock_timestamp()) * 1000;  -- after the lock's wait
    start := greatest(held, now_ms);
    IF start + step_ms - burst * step_ms > now_ms THEN
        RETURN (start + step_ms - burst * step_ms - now_ms) / 1000;
    END IF;
    UPDATE gateway_rates SET tat_ms = start + step_ms
        WHERE prefix = p_prefix AND name = p_name;
    RETURN 0;
END $$;
