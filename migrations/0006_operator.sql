-- Operator commands (`stock-ledger rejected list|show|replay`, run as the owner role).
-- An id to address a quarantined row by (identity: the worker's COPY leaves it out and needs no sequence grant),
-- and the outcome of the last replay attempt of a row that is still invalid under the current parser.
ALTER TABLE rejected_movements ADD COLUMN IF NOT EXISTS id bigint GENERATED ALWAYS AS IDENTITY;
ALTER TABLE rejected_movements ADD COLUMN IF NOT EXISTS replay_attempts integer NOT NULL DEFAULT 0;
ALTER TABLE rejected_movements ADD COLUMN IF NOT EXISTS last_replay_at timestamptz;
ALTER TABLE rejected_movements ADD COLUMN IF NOT EXISTS last_replay_reason text;
CREATE UNIQUE INDEX IF NOT EXISTS rejected_movements_id_key ON rejected_movements (id);
