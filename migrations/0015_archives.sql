-- Retention and archival (issue 39): segments of stock_movements older than STOCK_LEDGER_RETENTION_DAYS are written
-- to Parquet files with a manifest, checked against the segment, then detached and dropped (`stock-ledger archive
-- run`, archive/run.py). What stays online for each archived segment: its row in ledger_segments (archived_at set,
-- so no segment is ever made again below it), its row in ledger_archives, its per-(warehouse, sku) sums in
-- archived_sums (stock show --at, movements' running on-hand and the invariants read them), and its movement ids in
-- movement_ids (a resend of an archived movement is still recognised).

ALTER TABLE ledger_segments ADD COLUMN IF NOT EXISTS archived_at timestamptz;

CREATE TABLE IF NOT EXISTS ledger_archives (
    segment           text        PRIMARY KEY REFERENCES ledger_segments (table_name),
    kafka_topic       text        NOT NULL,
    kafka_partition   integer     NOT NULL CHECK (kafka_partition >= 0),
    first_offset      bigint      NOT NULL CHECK (first_offset >= 0),
    end_offset        bigint      NOT NULL CHECK (end_offset > first_offset),
    rows              bigint      NOT NULL CHECK (rows >= 0),
    qty               numeric     NOT NULL,
    first_occurred_at timestamptz,
    last_occurred_at  timestamptz,
    first_applied_at  timestamptz,
    last_applied_at   timestamptz,
    -- The file's name inside STOCK_LEDGER_ARCHIVE_DIR, its SHA-256 and size: `archive verify` checks all three.
    file              text        NOT NULL UNIQUE,
    sha256            text        NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    bytes             bigint      NOT NULL CHECK (bytes > 0),
    -- Offsets of the segment in no table that nobody can judge any more (applied before migration 0011 recorded
    -- which offsets held no record): archived as they were, counted here and in the manifest.
    unknown_offsets   bigint      NOT NULL DEFAULT 0 CHECK (unknown_offsets >= 0),
    archived_at       timestamptz NOT NULL DEFAULT now(),
    archived_by       text        NOT NULL DEFAULT current_user,
    -- NULL while the detached segment's table still exists (the next `archive run` drops it).
    dropped_at        timestamptz
);
CREATE INDEX IF NOT EXISTS ledger_archives_partition_idx ON ledger_archives (kafka_topic, kafka_partition, end_offset);

CREATE TABLE IF NOT EXISTS archived_sums (
    warehouse_id      text        NOT NULL,
    sku               text        NOT NULL,
    segment           text        NOT NULL REFERENCES ledger_archives (segment),
    rows              bigint      NOT NULL CHECK (rows > 0),
    qty               bigint      NOT NULL,
    first_occurred_at timestamptz NOT NULL,
    last_occurred_at  timestamptz NOT NULL,
    PRIMARY KEY (warehouse_id, sku, segment)
);
CREATE INDEX IF NOT EXISTS archived_sums_sku_idx ON archived_sums (sku);

-- A segment once archived is never made again: a write below an archived segment's end (only possible after
-- someone moved a stored offset back into the archived range) fails loudly instead of re-applying movements.
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
    archived bigint;
    name text;
BEGIN
    IF array_length(partitions, 1) IS DISTINCT FROM array_length(through, 1) THEN
        RAISE EXCEPTION 'stock_ledger_ensure_segments: % partitions, % offsets', array_length(partitions, 1),
            array_length(through, 1);
    END IF;
    PERFORM pg_advisory_xact_lock(7392012840117465811);
    FOR i IN 1 .. coalesce(array_length(partitions, 1), 0) LOOP
        p := partitions[i];
        archived := (SELECT max(s.end_offset) FROM public.ledger_segments AS s
                      WHERE s.kafka_partition = p AND s.archived_at IS NOT NULL);
        IF archived IS NOT NULL AND through[i] <= archived THEN
            RAISE EXCEPTION 'partition % offset % is in an archived segment (archived below offset %)', p,
                through[i] - 1, archived
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'a stored offset was moved back into the archived range: move it forward again '
                             '(stock-ledger offsets set); archived movements are never applied twice';
        END IF;
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

GRANT SELECT ON ledger_archives, archived_sums TO stock_ledger_app, stock_ledger_reader;
