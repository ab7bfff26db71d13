-- The monitor lease behind a pooler that shares server sessions per transaction (STOCK_LEDGER_DATABASE_POOLING=
-- transaction, PgBouncer's transaction mode), where a session-level advisory lock would belong to whichever client
-- next gets the server connection: one row per (group, topic), held by one worker process until expires_at, which
-- the holder pushes forward on every tick; another takes it only once it expired, and term counts the holders
-- (worker/lease.py, TableLease). Unused with sessions of their own (the advisory lock stays the lease there).
CREATE TABLE IF NOT EXISTS monitor_leases (
    group_id    text        NOT NULL,
    topic       text        NOT NULL,
    holder      text        NOT NULL,
    term        bigint      NOT NULL CHECK (term >= 1),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (group_id, topic)
);
GRANT SELECT, INSERT, UPDATE ON monitor_leases TO stock_ledger_app;
