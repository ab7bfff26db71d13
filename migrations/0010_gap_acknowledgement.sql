-- Issue 38: a worker may record a gap, never acknowledge one. 0003 granted INSERT on the whole of ledger_gaps, so the
-- worker's credential could move consumer_offsets past readable records and insert the range already acknowledged
-- (acknowledged_at, acknowledged_by, note filled): `verify` then listed those records as skipped on purpose and
-- `repair` left them alone. The worker now inserts only the columns a hole needs (what the runtime's
-- STOCK_LEDGER_ON_GAP=record writes); id and detected_at take their defaults, so it cannot backdate one either.
--
-- Rows written before this migration cannot be told apart by who inserted them, so `verify` and `repair` count an
-- acknowledgement only when acknowledged_by names a role that may UPDATE ledger_gaps.acknowledged_at (the owner, a
-- superuser, a role granted it: who can run `stock-ledger gaps ack`), whenever the row was written
-- (ledger/offsets.py, docs/security.md). The worker role never had that privilege.
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON ledger_gaps FROM stock_ledger_app;
GRANT INSERT (group_id, topic, partition, first_offset, last_offset, reason) ON ledger_gaps TO stock_ledger_app;
