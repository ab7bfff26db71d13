-- `stock-ledger verify --since T` finds, per partition, the first offset applied since T. The ledger is append-only,
-- so applied_at follows the physical order of the rows: a BRIN index answers that from a few pages, costs almost
-- nothing per insert and stays a few hundred kilobytes at hundreds of millions of rows. (Building it reads the
-- table once while holding a SHARE lock: on a very large ledger, apply this migration when a pause of a minute or
-- two in applying is acceptable.)
CREATE INDEX IF NOT EXISTS stock_movements_applied_at_brin ON stock_movements USING brin (applied_at);
CREATE INDEX IF NOT EXISTS rejected_movements_rejected_at_brin ON rejected_movements USING brin (rejected_at);
