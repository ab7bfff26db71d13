-- `stock-ledger repair` (issue 30): the audit trail of movements an earlier version skipped and repair re-applied
-- from Kafka. One row per repair transaction, written in that transaction: a row exists exactly when its movements
-- and quarantine rows do. Their applied_at / rejected_at equal repaired_at (now() is the transaction's start), which
-- finds the rows a repair wrote. Written by the owner role only: the worker role gets no grant on it.
CREATE TABLE IF NOT EXISTS ledger_repairs (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id           uuid        NOT NULL,
    repaired_at      timestamptz NOT NULL DEFAULT now(),
    repaired_by      text        NOT NULL DEFAULT current_user,
    group_id         text        NOT NULL,
    topic            text        NOT NULL,
    partition        integer     NOT NULL CHECK (partition >= 0),
    -- The lowest and highest offset this transaction wrote; `records` of them (applied + quarantined).
    first_offset     bigint      NOT NULL CHECK (first_offset >= 0),
    last_offset      bigint      NOT NULL CHECK (last_offset >= first_offset),
    records          integer     NOT NULL CHECK (records > 0),
    applied          integer     NOT NULL CHECK (applied >= 0),
    quarantined      integer     NOT NULL CHECK (quarantined >= 0),
    -- reason_code -> count of the quarantined ones.
    reasons          jsonb       NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS ledger_repairs_partition_idx ON ledger_repairs (group_id, topic, partition);
REVOKE ALL ON ledger_repairs FROM stock_ledger_app;
GRANT SELECT ON ledger_repairs TO stock_ledger_reader;
