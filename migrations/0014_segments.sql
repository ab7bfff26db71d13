-- stock-ledger: online
-- A ledger that lives for years (issue 39): stock_movements partitioned by Kafka coordinates, RANGE
-- (kafka_partition, kafka_offset), in segments of ledger_layout.segment_offsets offsets of one Kafka partition;
-- movement_id made unique by a registry, movement_ids, that every insert fills (a statement trigger). Why these
-- keys: docs/design.md, "A ledger that lives for years".
--
-- Online: the workers of the previous release keep writing while this runs. Each step below is its own
-- transaction (`migrate` runs them in order, each under lock_timeout, and this migration counts as applied only
-- after the last one); every step checks what is done and is safe to run again after an interruption.
--   prepare   the partitioned table (as stock_movements_next), its segments with one segment of headroom, the
--             registry and its trigger, the segment function, the copy procedure (no lock the workers wait on)
--   mirror    a trigger on the old table copies each insert into the new one (waits for a batch in flight)
--   copy      the old table's rows, 2,000 blocks (about 80,000 rows) per transaction, a progress line each
--   swap      the names change hands in one short transaction (waits for a batch in flight); the old table stays
--             as stock_movements_before_0014, read-only, for the way back (docs/operations.md)

-- step: prepare
CREATE TABLE IF NOT EXISTS ledger_layout (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- Offsets of one Kafka partition per segment: the unit that is created ahead and, later, archived.
    segment_offsets bigint  NOT NULL DEFAULT 10000000 CHECK (segment_offsets >= 10)
);
INSERT INTO ledger_layout DEFAULT VALUES ON CONFLICT DO NOTHING;

-- One row per segment: created ahead by stock_ledger_ensure_segments, never by hand.
CREATE TABLE IF NOT EXISTS ledger_segments (
    kafka_partition integer     NOT NULL CHECK (kafka_partition >= 0),
    first_offset    bigint      NOT NULL CHECK (first_offset >= 0),
    end_offset      bigint      NOT NULL CHECK (end_offset > first_offset),
    table_name      text        NOT NULL UNIQUE,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (kafka_partition, first_offset)
);

-- The id registry: movement_id unique across the ledger, whatever segment its movement is in (a unique index of a
-- partitioned table must hold the partition key). The constraint takes its final name at the swap.
CREATE TABLE IF NOT EXISTS movement_ids (
    movement_id uuid NOT NULL,
    CONSTRAINT movement_ids_pending_key PRIMARY KEY (movement_id)
);

-- Every writer registers the ids it inserts, in its own statement's transaction: the batch, `repair`, `rejected
-- replay`, and the previous release's workers during an upgrade. A known id fails the whole statement with
-- unique_violation on stock_movements_movement_id_key, as UNIQUE (movement_id) on the table did.
CREATE OR REPLACE FUNCTION stock_ledger_register_movement_ids() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $f$
BEGIN
    INSERT INTO public.movement_ids (movement_id) SELECT n.movement_id FROM new_rows AS n;
    RETURN NULL;
END
$f$;

-- A row deleted by hand (the worker may not delete) takes its id out of the registry with it: the ledger no longer
-- holds that movement, so `repair` or a replay may apply it again. A segment archived later is detached, not deleted:
-- its ids stay, and a resend of one is still recognised.
CREATE OR REPLACE FUNCTION stock_ledger_forget_movement_ids() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $f$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE public.movement_ids;
    ELSE
        DELETE FROM public.movement_ids AS m USING old_rows AS o WHERE m.movement_id = o.movement_id;
    END IF;
    RETURN NULL;
END
$f$;

DO $$
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = 'public.stock_movements'::regclass) = 'p'
       OR to_regclass('public.stock_movements_next') IS NOT NULL THEN
        RETURN;
    END IF;
    CREATE TABLE stock_movements_next (
        LIKE stock_movements INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED
    ) PARTITION BY RANGE (kafka_partition, kafka_offset);
    -- The backstop stays what it was: the coordinates are the partition key, so this holds across segments.
    ALTER TABLE stock_movements_next
        ADD CONSTRAINT stock_movements_next_coordinates_key UNIQUE (kafka_topic, kafka_partition, kafka_offset);
    CREATE INDEX stock_movements_next_applied_at_brin ON stock_movements_next USING brin (applied_at);
    CREATE TRIGGER register_movement_ids AFTER INSERT ON stock_movements_next
        REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION stock_ledger_register_movement_ids();
    CREATE TRIGGER forget_movement_ids AFTER DELETE ON stock_movements_next
        REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION stock_ledger_forget_movement_ids();
    CREATE TRIGGER forget_all_movement_ids AFTER TRUNCATE ON stock_movements_next
        FOR EACH STATEMENT EXECUTE FUNCTION stock_ledger_forget_movement_ids();
END
$$;

-- Segments ahead: for each Kafka partition, segments (contiguous from offset 0) until one whole segment lies beyond
-- `through`. SECURITY DEFINER so that the worker, which may not run DDL, keeps its own headroom; it can only add
-- segments at the bounds this function computes. One caller at a time (an advisory lock): two workers never create
-- the same segment. Each segment is created alone and then attached (ATTACH takes SHARE UPDATE EXCLUSIVE on the
-- table, which does not wait for a batch in flight; CREATE TABLE ... PARTITION OF would take ACCESS EXCLUSIVE).
-- Returns, per partition asked, where its last segment ends and the segment size.
CREATE OR REPLACE FUNCTION stock_ledger_ensure_segments(partitions integer[], through bigint[])
RETURNS TABLE (kafka_partition integer, end_offset bigint, segment_offsets bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, public AS $f$
DECLARE
    parent regclass := coalesce(to_regclass('public.stock_movements_next'), 'public.stock_movements'::regclass);
    size bigint := (SELECT l.segment_offsets FROM public.ledger_layout AS l);
    p integer;
    upto bigint;
    hi bigint;
    lo bigint;
    name text;
BEGIN
    IF array_length(partitions, 1) IS DISTINCT FROM array_length(through, 1) THEN
        RAISE EXCEPTION 'stock_ledger_ensure_segments: % partitions, % offsets', array_length(partitions, 1),
            array_length(through, 1);
    END IF;
    PERFORM pg_advisory_xact_lock(7392012840117465811);
    FOR i IN 1 .. coalesce(array_length(partitions, 1), 0) LOOP
        p := partitions[i];
        upto := greatest(through[i], 0) + size;
        hi := (SELECT max(s.end_offset) FROM public.ledger_segments AS s WHERE s.kafka_partition = p);
        WHILE hi IS NULL OR hi < upto LOOP
            -- The first segment of a partition reaches from 0 to the first multiple of the size past `upto`.
            lo := coalesce(hi, 0);
            hi := CASE WHEN hi IS NULL THEN ((upto + size - 1) / size) * size ELSE lo + size END;
            name := format('stock_movements_p%s_o%s', p, lo);
            EXECUTE format('CREATE TABLE public.%I (LIKE %s INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                           'INCLUDING GENERATED)', name, parent);
            -- Named so that a conflict says which backstop it hit (the worker reads the name); the CHECK lets
            -- ATTACH skip its scan, and a detached segment be attached again the same way.
            EXECUTE format('ALTER TABLE public.%I ADD CONSTRAINT %I UNIQUE (kafka_topic, kafka_partition, '
                           'kafka_offset), ADD CONSTRAINT %I CHECK (kafka_partition = %s AND kafka_offset >= %s '
                           'AND kafka_offset < %s)', name, name || '_coordinates_key', name || '_range', p, lo, hi);
            EXECUTE format('ALTER TABLE %s ATTACH PARTITION public.%I FOR VALUES FROM (%s, %s) TO (%s, %s)',
                           parent, name, p, lo, p, hi);
            INSERT INTO public.ledger_segments (kafka_partition, first_offset, end_offset, table_name)
            VALUES (p, lo, hi, name);
        END LOOP;
        kafka_partition := p;
        end_offset := hi;
        segment_offsets := size;
        RETURN NEXT;
    END LOOP;
END
$f$;
REVOKE ALL ON FUNCTION stock_ledger_ensure_segments(integer[], bigint[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION stock_ledger_ensure_segments(integer[], bigint[]) TO stock_ledger_app;

-- The segments the rows already in the ledger and the stored offsets need, each with a segment of headroom.
WITH need AS (
    SELECT p, max(n) AS n FROM (
        SELECT kafka_partition, max(kafka_offset) + 1 FROM stock_movements GROUP BY 1
        UNION ALL SELECT partition, next_offset FROM consumer_offsets WHERE next_offset IS NOT NULL
    ) AS a(p, n) GROUP BY p
)
SELECT count(*) FROM stock_ledger_ensure_segments((SELECT coalesce(array_agg(p ORDER BY p), '{}') FROM need),
                                                  (SELECT coalesce(array_agg(n ORDER BY p), '{}') FROM need));

-- Until the swap, each insert into the old table is copied into the new one in the same transaction.
CREATE OR REPLACE FUNCTION stock_ledger_mirror_0014() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, public AS $f$
BEGIN
    INSERT INTO public.stock_movements_next (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic,
                                             kafka_partition, kafka_offset, kafka_timestamp, applied_at)
    SELECT n.movement_id, n.warehouse_id, n.sku, n.qty, n.kind, n.occurred_at, n.kafka_topic, n.kafka_partition,
           n.kafka_offset, n.kafka_timestamp, n.applied_at FROM new_rows AS n
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$f$;

-- Block by block (a TID range scan: no index, no sort), committed every `chunk` blocks, a NOTICE per chunk (migrate
-- logs each as migration.progress). A row the mirror copied already is left as it is (ON CONFLICT DO NOTHING).
-- (No SET clause: a procedure with one cannot COMMIT. migrate's session pins the search_path, pg_catalog first.)
CREATE OR REPLACE PROCEDURE stock_ledger_copy_0014(chunk integer DEFAULT 2000)
LANGUAGE plpgsql AS $p$
DECLARE
    blocks bigint;
    b bigint := 0;
    n bigint;
    copied bigint := 0;
    started timestamptz := clock_timestamp();
BEGIN
    IF to_regclass('public.stock_movements_next') IS NULL THEN
        RETURN;  -- swapped already
    END IF;
    blocks := pg_relation_size('public.stock_movements') / current_setting('block_size')::bigint;
    WHILE b < blocks LOOP
        INSERT INTO public.stock_movements_next (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic,
                                                 kafka_partition, kafka_offset, kafka_timestamp, applied_at)
        SELECT movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition, kafka_offset,
               kafka_timestamp, applied_at
          FROM public.stock_movements
         WHERE ctid >= format('(%s,0)', b)::tid AND ctid < format('(%s,0)', b + chunk)::tid
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS n = ROW_COUNT;
        copied := copied + n;
        b := b + chunk;
        COMMIT;
        RAISE NOTICE 'stock_movements: % of % blocks copied, % rows, % s', least(b, blocks), blocks, copied,
            round(extract(epoch FROM clock_timestamp() - started));
    END LOOP;
END
$p$;

-- step: mirror
DO $$
BEGIN
    IF to_regclass('public.stock_movements_next') IS NOT NULL THEN
        CREATE OR REPLACE TRIGGER mirror_0014 AFTER INSERT ON stock_movements
            REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION stock_ledger_mirror_0014();
    END IF;
END
$$;
-- The previous release's workers insert through the mirror and the registry's trigger under their own role.
GRANT SELECT, INSERT ON movement_ids TO stock_ledger_app;
DO $$
BEGIN
    IF to_regclass('public.stock_movements_next') IS NOT NULL THEN
        GRANT SELECT, INSERT ON stock_movements_next TO stock_ledger_app;
    END IF;
END
$$;

-- step: copy
CALL stock_ledger_copy_0014();

-- step: swap
DO $$
BEGIN
    IF to_regclass('public.stock_movements_next') IS NULL THEN
        RETURN;
    END IF;
    LOCK TABLE stock_movements, stock_movements_next IN ACCESS EXCLUSIVE MODE;
    DROP TRIGGER mirror_0014 ON stock_movements;
    ALTER TABLE stock_movements RENAME CONSTRAINT stock_movements_coordinates_key
        TO stock_movements_before_0014_coordinates_key;
    ALTER TABLE stock_movements RENAME CONSTRAINT stock_movements_movement_id_key
        TO stock_movements_before_0014_movement_id_key;
    ALTER INDEX IF EXISTS stock_movements_applied_at_brin RENAME TO stock_movements_before_0014_applied_at_brin;
    ALTER TABLE stock_movements RENAME TO stock_movements_before_0014;
    ALTER TABLE stock_movements_next RENAME TO stock_movements;
    ALTER TABLE stock_movements RENAME CONSTRAINT stock_movements_next_coordinates_key
        TO stock_movements_coordinates_key;
    ALTER INDEX stock_movements_next_applied_at_brin RENAME TO stock_movements_applied_at_brin;
    ALTER TABLE movement_ids RENAME CONSTRAINT movement_ids_pending_key TO stock_movements_movement_id_key;
    -- The old table is kept, read-only, for the way back; drop it once the new layout has proved itself. A new
    -- ledger's is empty: nothing to keep.
    IF EXISTS (SELECT FROM stock_movements_before_0014) THEN
        REVOKE ALL ON stock_movements_before_0014 FROM stock_ledger_app;
    ELSE
        DROP TABLE stock_movements_before_0014;
    END IF;
    DROP FUNCTION stock_ledger_mirror_0014();
    DROP PROCEDURE stock_ledger_copy_0014(integer);
END
$$;
GRANT SELECT, INSERT ON stock_movements, movement_ids TO stock_ledger_app;
GRANT SELECT ON stock_movements, movement_ids, ledger_layout, ledger_segments TO stock_ledger_reader;
