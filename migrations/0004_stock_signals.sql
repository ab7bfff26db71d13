-- Signals a warehouse can act on (issue 16): which (warehouse, sku) pairs are below zero and since when, read
-- cheaply; and a read-only role for `stock-ledger stock show` / `stock-ledger movements`.
-- Independent of 0003 (the lead's ledger_gaps): nothing here names it.

-- Set by the batch transaction's level upsert (sink._ADD_LEVELS) when a level goes below zero (the commit's
-- time, i.e. application time, at batch granularity), kept while it stays below, cleared when it recovers.
ALTER TABLE stock_levels ADD COLUMN IF NOT EXISTS went_negative_at timestamptz;

-- Levels already negative before this migration: the time of their last change is the best bound we have (the
-- level was negative at least since then).
UPDATE stock_levels SET went_negative_at = updated_at WHERE on_hand < 0 AND went_negative_at IS NULL;

-- So the metric and `stock show --negative` can trust the column: every writer of on_hand must keep it in step.
ALTER TABLE stock_levels DROP CONSTRAINT IF EXISTS stock_levels_went_negative_at_check;
ALTER TABLE stock_levels ADD CONSTRAINT stock_levels_went_negative_at_check
    CHECK ((on_hand < 0) = (went_negative_at IS NOT NULL));

-- The negative pairs, and nothing else. The predicate is on went_negative_at, not on on_hand: a column an index
-- names (predicate included) makes every UPDATE that changes it a non-HOT update, and on_hand changes on every
-- batch, went_negative_at only when a level crosses zero (measured with scripts/bench_signals.py, README).
CREATE INDEX IF NOT EXISTS stock_levels_negative_idx ON stock_levels (warehouse_id, sku)
    WHERE went_negative_at IS NOT NULL;

-- Read-only access for people and tools: SELECT on every table, nothing else (no INSERT/UPDATE/DELETE/TRUNCATE,
-- no DDL). Log in as a member: CREATE ROLE alice LOGIN IN ROLE stock_ledger_reader (README, "Roles").
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'stock_ledger_reader') THEN
        CREATE ROLE stock_ledger_reader NOLOGIN;
    END IF;
EXCEPTION
    -- Two databases of one cluster migrated at once race on the cluster-wide role name.
    WHEN duplicate_object OR unique_violation THEN NULL;
END
$$;

GRANT SELECT ON ALL TABLES IN SCHEMA public TO stock_ledger_reader;
-- Tables later migrations create (they run as this same owner) are readable too, without a grant in each.
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO stock_ledger_reader;
