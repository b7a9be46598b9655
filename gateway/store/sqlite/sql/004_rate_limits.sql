-- Rate limits (Store.take_token, gateway/store/rate.py): per name, the bucket's
-- theoretical arrival time in ms of the store's clock. A take is one operation, under
-- the file's write lock, so takes of every process on the file are one after another.
CREATE TABLE gateway_rates (
    name   TEXT PRIMARY KEY,
    tat_ms REAL NOT NULL
);
