-- The ledger. Every Kafka record of the topic ends in exactly one of stock_movements or rejected_movements,
-- and consumer_offsets says how far each partition has been applied, all written in one transaction per batch.

CREATE TABLE IF NOT EXISTS stock_movements (
    movement_id      uuid        NOT NULL,
    warehouse_id     text        NOT NULL CHECK (length(warehouse_id) BETWEEN 1 AND 64),
    sku              text        NOT NULL CHECK (length(sku) BETWEEN 1 AND 64),
    qty              bigint      NOT NULL CHECK (qty <> 0 AND abs(qty) <= 1000000000),
    kind             text        NOT NULL CHECK (kind IN ('receipt', 'return', 'transfer_in', 'pick', 'transfer_out', 'adjustment')),
    occurred_at      timestamptz NOT NULL,
    kafka_topic      text        NOT NULL,
    kafka_partition  integer     NOT NULL CHECK (kafka_partition >= 0),
    kafka_offset     bigint      NOT NULL CHECK (kafka_offset >= 0),
    kafka_timestamp  timestamptz,
    applied_at       timestamptz NOT NULL DEFAULT now(),
    -- The staging check reads `count(DISTINCT source)`; generated so it can never disagree with the coordinates.
    source           text        GENERATED ALWAYS AS
                     (kafka_topic || '/' || kafka_partition::text || '/' || kafka_offset::text) STORED,
    -- The backstop: a regression that re-applies a record fails loudly here instead of duplicating stock.
    CONSTRAINT stock_movements_coordinates_key UNIQUE (kafka_topic, kafka_partition, kafka_offset),
    -- An upstream resend (same movement, new offset) is quarantined by the worker; this makes it impossible twice.
    CONSTRAINT stock_movements_movement_id_key UNIQUE (movement_id)
);

CREATE TABLE IF NOT EXISTS rejected_movements (
    kafka_topic      text        NOT NULL,
    kafka_partition  integer     NOT NULL CHECK (kafka_partition >= 0),
    kafka_offset     bigint      NOT NULL CHECK (kafka_offset >= 0),
    kafka_timestamp  timestamptz,
    key              bytea,
    value            bytea,
    reason_code      text        NOT NULL,
    reason           text        NOT NULL,
    movement_id      uuid,
    rejected_at      timestamptz NOT NULL DEFAULT now(),
    source           text        GENERATED ALWAYS AS
                     (kafka_topic || '/' || kafka_partition::text || '/' || kafka_offset::text) STORED,
    CONSTRAINT rejected_movements_coordinates_key UNIQUE (kafka_topic, kafka_partition, kafka_offset)
);

CREATE INDEX IF NOT EXISTS rejected_movements_reason_code_idx ON rejected_movements (reason_code, rejected_at);

-- The source of truth for positions. Kafka's committed offsets are advisory (dashboards only).
CREATE TABLE IF NOT EXISTS consumer_offsets (
    group_id     text        NOT NULL,
    topic        text        NOT NULL,
    partition    integer     NOT NULL CHECK (partition >= 0),
    -- NULL until the first batch: "no stored offset", so the reset policy applies.
    next_offset  bigint      CHECK (next_offset >= 0),
    -- The fencing token: bumped by every claim; a batch commits only if it still holds the epoch it claimed.
    epoch        bigint      NOT NULL DEFAULT 1,
    -- Diagnostics only (who claimed, under which Kafka generation); never used for decisions.
    generation   integer,
    member_id    text,
    claimed_at   timestamptz,
    updated_at   timestamptz,
    PRIMARY KEY (group_id, topic, partition)
);

CREATE TABLE IF NOT EXISTS stock_levels (
    warehouse_id text        NOT NULL,
    sku          text        NOT NULL,
    on_hand      bigint      NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (warehouse_id, sku)
);
