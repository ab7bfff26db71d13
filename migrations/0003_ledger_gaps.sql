-- Holes in the log (retention, deleted records) that the ledger moved past, recorded in the transaction that moved
-- past them (STOCK_LEDGER_ON_GAP=record) or by an operator (`stock-ledger offsets set`). `stock-ledger verify`
-- fails while any is unacknowledged.
CREATE TABLE IF NOT EXISTS ledger_gaps (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    group_id         text        NOT NULL,
    topic            text        NOT NULL,
    partition        integer     NOT NULL CHECK (partition >= 0),
    first_offset     bigint      NOT NULL CHECK (first_offset >= 0),
    last_offset      bigint      NOT NULL CHECK (last_offset >= first_offset),
    reason           text        NOT NULL,
    detected_at      timestamptz NOT NULL DEFAULT now(),
    acknowledged_at  timestamptz,
    acknowledged_by  text,
    note             text
);
CREATE INDEX IF NOT EXISTS ledger_gaps_partition_idx ON ledger_gaps (group_id, topic, partition);
CREATE INDEX IF NOT EXISTS ledger_gaps_unacknowledged_idx ON ledger_gaps (id) WHERE acknowledged_at IS NULL;
GRANT SELECT, INSERT ON ledger_gaps TO stock_ledger_app;
