-- Least privilege: the worker connects as a LOGIN role that is a member of stock_ledger_app, which may read and
-- append to the ledger and move offsets and stock levels, and nothing more: no DELETE, TRUNCATE or DDL.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'stock_ledger_app') THEN
        CREATE ROLE stock_ledger_app NOLOGIN;
    END IF;
EXCEPTION
    -- Two databases of one cluster migrated at once race on the cluster-wide role name.
    WHEN duplicate_object OR unique_violation THEN NULL;
END
$$;

REVOKE ALL ON stock_movements, rejected_movements, consumer_offsets, stock_levels FROM stock_ledger_app;
GRANT SELECT, INSERT ON stock_movements, rejected_movements TO stock_ledger_app;
GRANT SELECT, INSERT, UPDATE ON consumer_offsets, stock_levels TO stock_ledger_app;
GRANT SELECT ON schema_migrations TO stock_ledger_app;
