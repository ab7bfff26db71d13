-- Closings placed in business time, and BRIN summaries the monitor keeps right (issue 39).
--
-- 1. `ledger_closings.positioned_at`: where a closing sits in business time, which the reader compares with T to pick
--    the closing with the fewest movements on the wrong side: the median, over the Kafka partitions, of the Kafka
--    timestamp of the newest movement it counts (`taken_at` if it counts none). Not `taken_at`: a closing taken while
--    the workers catch up on a backlog counts movements hours older than the clock. Closings taken before this
--    migration, and those the previous release's monitors take while the pods roll (they do not name the column),
--    are placed at `taken_at`, where those monitors' readers looked for them.
-- 2. The BRIN ranges of the ledger's tables summarized again by the monitor (`stock_ledger_summarize_brins`):
--    a summarization that is interrupted (autovacuum's, cancelled whenever another session asks for a conflicting
--    lock on the table: an ANALYZE, an index build, a LOCK) leaves a *placeholder* range that nothing summarizes
--    again, and PostgreSQL's BRIN scan, once it has read one, takes every later range of the index as matching
--    (bringetbitmap reuses its deformed tuple and never resets bt_placeholder: 15 and later alike). At 100M movements
--    one such range made `stock show --at` read whole segments (docs/performance.md, "Reads as of a time"); the
--    BRINs on applied_at (`verify --since`, the invariants, `archive run`) and on rejected_at are exposed the same way.
--
-- Plain DDL on small tables (ledger_closings has a row per closing), under migrate's lock_timeout.

ALTER TABLE ledger_closings ADD COLUMN IF NOT EXISTS positioned_at timestamptz NOT NULL DEFAULT now();
UPDATE ledger_closings SET positioned_at = taken_at WHERE positioned_at <> taken_at;
CREATE INDEX IF NOT EXISTS ledger_closings_positioned_at_idx ON ledger_closings (kafka_topic, positioned_at);

-- Per BRIN, the blocks below which stock_ledger_summarize_brins summarized every range itself. `filenode`: the index's
-- file when the mark was set; a TRUNCATE or a REINDEX gives it a new one, and the mark starts again from 0.
CREATE TABLE IF NOT EXISTS brin_summaries (
    segment_index   text   PRIMARY KEY,
    filenode        oid    NOT NULL,
    verified_blocks bigint NOT NULL CHECK (verified_blocks >= 0)
);
GRANT SELECT ON brin_summaries TO stock_ledger_reader;

-- Every BRIN of the ledger's tables (stock_movements' segments, rejected_movements), with its mark (0 when unmarked
-- or when the index has a new file) and its table's size in blocks: how far behind the monitor's pass is
-- (stock_ledger_brin_ranges_behind).
CREATE OR REPLACE VIEW brin_backlog AS
SELECT s.*, greatest(s.blocks - s.verified, 0) AS blocks_behind FROM (
    SELECT x.indexrelid::regclass AS brin, x.indrelid::regclass AS heap,
           pg_relation_filenode(x.indexrelid) AS filenode,
           CASE WHEN b.filenode = pg_relation_filenode(x.indexrelid) THEN b.verified_blocks ELSE 0 END AS verified,
           pg_relation_size(x.indrelid) / current_setting('block_size')::bigint AS blocks,
           coalesce((SELECT o.option_value::bigint FROM pg_options_to_table(c.reloptions) AS o
                      WHERE o.option_name = 'pages_per_range'), 128) AS pages_per_range
      FROM pg_index AS x
      JOIN pg_class AS c ON c.oid = x.indexrelid
      JOIN pg_am AS a ON a.oid = c.relam AND a.amname = 'brin'
      LEFT JOIN brin_summaries AS b ON b.segment_index = x.indexrelid::regclass::text
     WHERE x.indrelid IN (SELECT i.inhrelid FROM pg_inherits AS i WHERE i.inhparent = 'stock_movements'::regclass)
        OR x.indrelid = 'rejected_movements'::regclass) AS s;
GRANT SELECT ON brin_backlog TO stock_ledger_reader, stock_ledger_app;

-- The monitor's leader calls this on each closings tick (at most every 5 minutes): the ranges above each mark (what
-- autosummarize and autovacuum summarized since, or left unsummarized when autovacuum's queue was full, or left as a
-- placeholder) are desummarized and summarized again, at most `budget` ranges per call, the indexes with the least
-- to do first. It never waits for a table's lock (NOWAIT: a session waiting on autovacuum is what cancels it); a
-- table autovacuum is working on is done on the next call. SECURITY DEFINER: summarizing takes the index owner's
-- rights; SHARE UPDATE EXCLUSIVE on a table, which no batch waits for. Returns the ranges summarized.
CREATE OR REPLACE FUNCTION stock_ledger_summarize_brins(budget bigint DEFAULT 2048) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $f$
DECLARE
    summarized bigint := 0;
    target record;
    blk bigint;
BEGIN
    DELETE FROM public.brin_summaries AS b WHERE to_regclass(b.segment_index) IS NULL;
    FOR target IN SELECT * FROM public.brin_backlog WHERE blocks_behind > 0 ORDER BY blocks_behind, brin::text LOOP
        EXIT WHEN budget <= 0;
        BEGIN
            EXECUTE format('LOCK TABLE ONLY %s IN SHARE UPDATE EXCLUSIVE MODE NOWAIT', target.heap);
        EXCEPTION WHEN lock_not_available OR undefined_table THEN  -- busy, or archived meanwhile
            CONTINUE;
        END;
        blk := target.verified / target.pages_per_range * target.pages_per_range;
        WHILE blk < target.blocks AND budget > 0 LOOP
            PERFORM brin_desummarize_range(target.brin, blk);
            summarized := summarized + brin_summarize_range(target.brin, blk);
            blk := blk + target.pages_per_range;
            budget := budget - 1;
        END LOOP;
        -- The last range may still be filling: summarized now, inserts keep it right, and nothing summarizes a range
        -- that has a summary, so it cannot become a placeholder.
        INSERT INTO public.brin_summaries AS b (segment_index, filenode, verified_blocks)
        VALUES (target.brin::text, target.filenode, blk)
        ON CONFLICT (segment_index) DO UPDATE SET filenode = excluded.filenode, verified_blocks = excluded.verified_blocks;
    END LOOP;
    RETURN summarized;
END
$f$;
REVOKE ALL ON FUNCTION stock_ledger_summarize_brins(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION stock_ledger_summarize_brins(bigint) TO stock_ledger_app;

-- What the previous release's monitors call after each closing (its own pass, brin_summarize_new_values, only
-- summarized ranges never summarized, and waited for each segment's lock). Kept for them while the pods roll; a
-- later migration drops it.
CREATE OR REPLACE FUNCTION stock_ledger_summarize_occurred() RETURNS bigint
LANGUAGE sql SET search_path = pg_catalog, public AS $f$ SELECT public.stock_ledger_summarize_brins() $f$;
