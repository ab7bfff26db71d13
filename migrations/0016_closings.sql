-- stock-ledger: online
-- Fast "as of" reads (issue 39): closing balances, and the indexes that find a time window's movements.
--
-- A closing is stock_levels copied in one snapshot together with the stored offsets (its cut): it counts exactly
-- the movements whose coordinates lie below the cut. `stock show --at T` reads the closing taken nearest after T
-- and the few movements on the wrong side of it (docs/design.md, "Closings"). Taken by the monitor's leader every
-- STOCK_LEDGER_CLOSING_SECONDS; nothing in the batch writes them, so the ingest path pays only the two indexes.
--
-- Online: each step is its own transaction (or, for the index, one per segment), safe to run again.
--   prepare   the closing tables; the indexes on the partitioned table only (no segment indexed yet: no lock waited on)
--   index     the two indexes on each segment, one transaction each (a SHARE lock on that segment for its build:
--             seconds on a segment of 10M movements), attached to the table's, a progress line each
--   finish    checks that every segment has both (the table's are then valid, and segments made later get them)

-- step: prepare
-- One row per closing. `taken_at`: the transaction time of the snapshot (application time), which the reader
-- compares with business time only to pick the closing whose window of stragglers is smallest.
CREATE TABLE IF NOT EXISTS ledger_closings (
    closing_id  bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kafka_topic text        NOT NULL,
    taken_at    timestamptz NOT NULL DEFAULT now(),
    pairs       bigint      NOT NULL CHECK (pairs >= 0),
    seconds     real        NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS ledger_closings_taken_at_idx ON ledger_closings (kafka_topic, taken_at);

-- The cut: per Kafka partition, the first offset the closing does not count (the stored offset when it was taken).
-- A partition without a row here is counted from nowhere: cut 0.
CREATE TABLE IF NOT EXISTS closing_cuts (
    closing_id      bigint  NOT NULL REFERENCES ledger_closings ON DELETE CASCADE,
    kafka_partition integer NOT NULL CHECK (kafka_partition >= 0),
    next_offset     bigint  NOT NULL CHECK (next_offset >= 0),
    PRIMARY KEY (closing_id, kafka_partition)
);

-- The balances: Σ qty of the movements of each (warehouse, sku) below the cut, archived ones included. `repair` and
-- `rejected replay` add what they later write below a cut (ledger/closings.py, in their own transactions).
CREATE TABLE IF NOT EXISTS stock_closings (
    closing_id   bigint NOT NULL REFERENCES ledger_closings ON DELETE CASCADE,
    warehouse_id text   NOT NULL,
    sku          text   NOT NULL,
    on_hand      bigint NOT NULL,
    PRIMARY KEY (closing_id, warehouse_id, sku)
);

-- A row deleted by hand (the worker may not delete; archival detaches, it does not delete) leaves the closings that
-- counted it, as it leaves movement_ids: `repair` may then write it again and `include` it again. A TRUNCATE leaves
-- nothing for any closing to count. Both order themselves against a closing being taken, as `include` does.
CREATE OR REPLACE FUNCTION stock_ledger_uncount_closings() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $f$
BEGIN
    LOCK TABLE public.ledger_closings IN ROW EXCLUSIVE MODE;
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM public.ledger_closings;
        RETURN NULL;
    END IF;
    INSERT INTO public.stock_closings AS s (closing_id, warehouse_id, sku, on_hand)
    SELECT c.closing_id, o.warehouse_id, o.sku, -sum(o.qty)
      FROM old_rows AS o
      JOIN public.ledger_closings AS k ON k.kafka_topic = o.kafka_topic
      JOIN public.closing_cuts AS c
        ON c.closing_id = k.closing_id AND c.kafka_partition = o.kafka_partition AND o.kafka_offset < c.next_offset
     GROUP BY 1, 2, 3
    ON CONFLICT (closing_id, warehouse_id, sku) DO UPDATE SET on_hand = s.on_hand + excluded.on_hand;
    RETURN NULL;
END
$f$;
CREATE OR REPLACE TRIGGER uncount_closings AFTER DELETE ON stock_movements
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION stock_ledger_uncount_closings();
CREATE OR REPLACE TRIGGER uncount_all_closings AFTER TRUNCATE ON stock_movements
    FOR EACH STATEMENT EXECUTE FUNCTION stock_ledger_uncount_closings();

GRANT SELECT, INSERT, UPDATE, DELETE ON ledger_closings, closing_cuts, stock_closings TO stock_ledger_app;
GRANT SELECT ON ledger_closings, closing_cuts, stock_closings TO stock_ledger_reader;
-- A closing's cut names every partition the ledger has segments of.
GRANT SELECT ON ledger_segments TO stock_ledger_app;

-- The movements of a time window, in two parts (ledger/stock.py reads both):
-- - in step: occurred_at from 15 minutes before to 5 minutes after the record's Kafka timestamp (or, with none, the
--   time the ledger applied it): nearly all of them, in offset order nearly in time order. A BRIN on business time
--   and offset keeps, per segment (one Kafka partition), the block ranges that hold both a window of times and a
--   range of offsets. Partial: one back-dated movement among thousands would otherwise stretch its range's summary
--   over the hours in between, and every read would scan it.
-- - out of step: the rest (a scanner that uploads a day late, a clock hours ahead, a record `repair` or `rejected
--   replay` writes late). A B-tree on the offset holds only them, with what a read needs.
-- autosummarize: a block range is summarized soon after it fills (an unsummarized range is read by every query).
CREATE INDEX IF NOT EXISTS stock_movements_occurred_brin ON ONLY stock_movements
    USING brin (occurred_at, kafka_offset) WITH (autosummarize = on)
    WHERE (occurred_at - coalesce(kafka_timestamp, applied_at)) BETWEEN interval '-15 minutes' AND interval '5 minutes';
CREATE INDEX IF NOT EXISTS stock_movements_out_of_step_idx ON ONLY stock_movements
    USING btree (kafka_offset) INCLUDE (occurred_at, warehouse_id, sku, qty, kafka_topic, kafka_partition)
    WHERE NOT ((occurred_at - coalesce(kafka_timestamp, applied_at))
               BETWEEN interval '-15 minutes' AND interval '5 minutes');

-- What autosummarize left (its requests are dropped when autovacuum's queue is full, at a high ingest rate): the
-- monitor calls this after each closing. SECURITY DEFINER: summarizing takes the index owner's rights; it takes
-- SHARE UPDATE EXCLUSIVE on each segment, which no batch waits for.
CREATE OR REPLACE FUNCTION stock_ledger_summarize_occurred() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $f$
DECLARE
    summarized bigint := 0;
    segment_index regclass;
BEGIN
    FOR segment_index IN SELECT i.inhrelid::regclass FROM pg_inherits AS i
                          WHERE i.inhparent = 'public.stock_movements_occurred_brin'::regclass LOOP
        summarized := summarized + brin_summarize_new_values(segment_index);
    END LOOP;
    RETURN summarized;
END
$f$;
REVOKE ALL ON FUNCTION stock_ledger_summarize_occurred() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION stock_ledger_summarize_occurred() TO stock_ledger_app;

-- Each segment without an index gets it and is attached; segments made meanwhile are found on the next pass.
-- (No SET clause: a procedure with one cannot COMMIT. migrate's session pins the search_path, pg_catalog first.)
CREATE OR REPLACE PROCEDURE stock_ledger_index_0016()
LANGUAGE plpgsql AS $p$
DECLARE
    parent text;
    segment text;
    child text;
    built bigint := 0;
    segments bigint;
    started timestamptz := clock_timestamp();
    in_step constant text := '(occurred_at - coalesce(kafka_timestamp, applied_at)) '
                             'BETWEEN interval ''-15 minutes'' AND interval ''5 minutes''';
BEGIN
    LOOP
        SELECT x.parent, c.relname INTO parent, segment
          FROM (VALUES ('stock_movements_occurred_brin'), ('stock_movements_out_of_step_idx')) AS x(parent),
               pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'public.stock_movements'::regclass
           AND NOT EXISTS (SELECT FROM pg_inherits AS y JOIN pg_index AS ix ON ix.indexrelid = y.inhrelid
                            WHERE y.inhparent = format('public.%I', x.parent)::regclass AND ix.indrelid = c.oid)
         ORDER BY c.relname, x.parent LIMIT 1;
        EXIT WHEN segment IS NULL;
        IF parent = 'stock_movements_occurred_brin' THEN
            child := segment || '_occurred_brin';
            EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON public.%I USING brin (occurred_at, kafka_offset) '
                           'WITH (autosummarize = on) WHERE %s', child, segment, in_step);
        ELSE
            child := segment || '_out_of_step_idx';
            EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON public.%I USING btree (kafka_offset) '
                           'INCLUDE (occurred_at, warehouse_id, sku, qty, kafka_topic, kafka_partition) WHERE NOT (%s)', child,
                           segment, in_step);
        END IF;
        EXECUTE format('ALTER INDEX public.%I ATTACH PARTITION public.%I', parent, child);
        built := built + 1;
        COMMIT;
        SELECT count(*) INTO segments FROM pg_inherits AS i WHERE i.inhparent = 'public.stock_movements'::regclass;
        RAISE NOTICE '%: % (% indexes built, % segments, % s)', parent, segment, built, segments,
            round(extract(epoch FROM clock_timestamp() - started));
    END LOOP;
END
$p$;

-- step: index
CALL stock_ledger_index_0016();

-- step: finish
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_index WHERE indexrelid IN ('public.stock_movements_occurred_brin'::regclass,
                                                          'public.stock_movements_out_of_step_idx'::regclass)
                                      AND NOT indisvalid) THEN
        RAISE EXCEPTION 'stock_movements_occurred_brin or stock_movements_out_of_step_idx is not valid yet: a '
            'segment lacks it; run migrate again';
    END IF;
END
$$;
DROP PROCEDURE IF EXISTS stock_ledger_index_0016();
