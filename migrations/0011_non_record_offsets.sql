-- Offsets that held no data record: transaction markers (commit and abort) and the records of aborted producer
-- transactions. read_committed never returns them, so the worker sees, in each batch, which offsets between the
-- stored offset and the next one it stores held none, and writes them here in the batch transaction, only where a
-- batch has some (a topic without transactional producers writes nothing here): one row per partition of such a
-- batch, its runs as (first, last) pairs in one array, so a batch writes at most one row per partition however many
-- transactions it spans. Once retention deletes them, Kafka can no longer say whether an offset held a record: the
-- ledger can. `verify`, `repair` and the invariant checks take an offset below the log start that neither movement
-- table holds for a hole only if it is not here and lies in the range the ledger knows (below).
CREATE TABLE IF NOT EXISTS non_record_offsets (
    kafka_topic      text     NOT NULL,
    kafka_partition  integer  NOT NULL CHECK (kafka_partition >= 0),
    first_offset     bigint   NOT NULL CHECK (first_offset >= 0),  -- the first run's first offset
    last_offset      bigint   NOT NULL CHECK (last_offset >= first_offset),  -- the last run's last offset
    -- first, last, first, last, ... of each run, in offset order
    runs             bigint[] NOT NULL CHECK (cardinality(runs) >= 2 AND cardinality(runs) % 2 = 0
                                              AND runs[1] = first_offset AND runs[cardinality(runs)] = last_offset),
    CONSTRAINT non_record_offsets_pkey PRIMARY KEY (kafka_topic, kafka_partition, first_offset)
);

-- [non_records_known_from, non_records_known_to): the offsets of the partition whose non-record offsets are all in
-- non_record_offsets. Every move of next_offset by this version moves non_records_known_to with it; a version
-- before this one moves next_offset alone, so a claim that finds the two apart starts the known range afresh at
-- the stored offset (an older worker applied what lies between without recording). NULL: nothing known (a ledger
-- written before this migration, until its first claim by this version).
ALTER TABLE consumer_offsets ADD COLUMN IF NOT EXISTS non_records_known_from bigint;
ALTER TABLE consumer_offsets ADD COLUMN IF NOT EXISTS non_records_known_to bigint;

REVOKE ALL ON non_record_offsets FROM stock_ledger_app;
GRANT SELECT, INSERT ON non_record_offsets TO stock_ledger_app;
GRANT SELECT ON non_record_offsets TO stock_ledger_reader;
