"""The cost of each candidate layout for a long-lived ledger on an empty ledger, side by side in one run.

Each round creates one scratch database per layout and writes the same batches into each, in turn: a batch is
10,000 movements spread over 24 Kafka partitions at consecutive offsets, written as the worker writes them (one
transaction, asyncpg COPY). Reported per layout: the median batch time, its ratio to today's layout, and WAL bytes
and full-page images per movement (pg_stat_wal). This measures PostgreSQL's side only (no Kafka, no parsing).

  python docs/bench/layouts-2026-12-03/layouts.py --batches 60 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

ADMIN = "postgresql://stock_ledger:stock_ledger@127.0.0.1:5432/stock_ledger"
PARTITIONS = 24
COLUMNS = ("movement_id", "warehouse_id", "sku", "qty", "kind", "occurred_at",
           "kafka_topic", "kafka_partition", "kafka_offset", "kafka_timestamp")
TABLE = """
CREATE TABLE stock_movements (
    movement_id uuid NOT NULL, warehouse_id text NOT NULL CHECK (length(warehouse_id) BETWEEN 1 AND 64),
    sku text NOT NULL CHECK (length(sku) BETWEEN 1 AND 64), qty bigint NOT NULL CHECK (qty <> 0),
    kind text NOT NULL, occurred_at timestamptz NOT NULL, kafka_topic text NOT NULL,
    kafka_partition integer NOT NULL, kafka_offset bigint NOT NULL, kafka_timestamp timestamptz,
    applied_at timestamptz NOT NULL DEFAULT now(),
    source text GENERATED ALWAYS AS (kafka_topic || '/' || kafka_partition::text || '/' || kafka_offset::text) STORED,
    {constraints}
) {partitioning}
"""
REGISTRY = "CREATE TABLE movement_ids (movement_id uuid PRIMARY KEY)"
TRIGGER = """
CREATE FUNCTION register_ids() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN INSERT INTO movement_ids SELECT movement_id FROM new_rows; RETURN NULL; END $$;
CREATE TRIGGER register_ids AFTER INSERT ON stock_movements REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION register_ids();
"""
BRIN = "CREATE INDEX ON stock_movements USING brin (applied_at)"
COORDS = "UNIQUE (kafka_topic, kafka_partition, kafka_offset)"


def _offset_partitions() -> list[str]:
    return [f"CREATE TABLE stock_movements_p{p}_0 PARTITION OF stock_movements "
            f"FOR VALUES FROM ({p}, 0) TO ({p}, 1000000000)" for p in range(PARTITIONS)]


def _list_range_partitions() -> list[str]:
    return [statement for p in range(PARTITIONS) for statement in (
        (f"CREATE TABLE stock_movements_p{p} PARTITION OF stock_movements FOR VALUES IN ({p}) "
         "PARTITION BY RANGE (kafka_offset)"),
        f"CREATE TABLE stock_movements_p{p}_0 PARTITION OF stock_movements_p{p} FOR VALUES FROM (0) TO (1000000000)")]


def _day_partitions(today: datetime) -> list[str]:
    days = [today + timedelta(days=d) for d in range(-3, 4)]
    return [f"CREATE TABLE stock_movements_{d:%Y%m%d} PARTITION OF stock_movements "
            f"FOR VALUES FROM ('{d.isoformat()}') TO ('{(d + timedelta(days=1)).isoformat()}')" for d in days]


def layouts(today: datetime) -> dict[str, list[str]]:
    return {
        # migrations/0001 + 0005 as they are
        "today": [TABLE.format(constraints=f"{COORDS}, UNIQUE (movement_id)", partitioning=""), BRIN],
        # RANGE (kafka_partition, kafka_offset): the coordinates stay unique across the table; movement_id moves to
        # a registry the batch writes with a second COPY
        "offsets+registry": [TABLE.format(constraints=COORDS, partitioning="PARTITION BY RANGE (kafka_partition, "
                                          "kafka_offset)"), *_offset_partitions(), BRIN, REGISTRY],
        # LIST (kafka_partition), each RANGE (kafka_offset): ranges per Kafka partition, the registry by COPY
        "lists+registry": [TABLE.format(constraints=COORDS, partitioning="PARTITION BY LIST (kafka_partition)"),
                           *_list_range_partitions(), BRIN, REGISTRY],
        # the same registry filled by a statement trigger (every writer, old releases' workers included)
        "offsets+trigger": [TABLE.format(constraints=COORDS, partitioning="PARTITION BY RANGE (kafka_partition, "
                                         "kafka_offset)"), *_offset_partitions(), BRIN, REGISTRY, TRIGGER],
        # RANGE (occurred_at) by UTC day: both keys must include occurred_at
        "days": [TABLE.format(constraints="UNIQUE (kafka_topic, kafka_partition, kafka_offset, occurred_at), "
                              "UNIQUE (movement_id, occurred_at)", partitioning="PARTITION BY RANGE (occurred_at)"),
                 *_day_partitions(today), BRIN],
    }


def batch(n: int, start: dict[int, int], now: datetime) -> list[tuple[object, ...]]:
    rows = []
    for i in range(n):
        p = i % PARTITIONS
        rows.append((uuid.uuid4(), f"WH-{i % 7:03d}", f"SKU-{(i * 7919) % 50000:06d}", 5, "receipt",
                     now - timedelta(seconds=i % 3600), "warehouse.movements", p, start[p], now))
        start[p] += 1
    return rows


async def wal(conn: asyncpg.Connection) -> tuple[int, int]:
    """WAL position (bytes written, every backend) and full-page images so far (this backend's counts flushed
    first: they reach pg_stat_wal only about once a second otherwise)."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT 1")
    r = await conn.fetchrow("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, wal_fpi FROM pg_stat_wal")
    return int(r[0]), int(r[1])


async def run_layout(name: str, ddl: list[str], batches: list[list[tuple[object, ...]]],
                     separate_registry: bool) -> tuple[float, float, float]:
    db = f"layout_{name.replace('+', '_')}_{uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(ADMIN)
    await admin.execute(f'CREATE DATABASE "{db}"')
    try:
        conn = await asyncpg.connect(ADMIN.rsplit("/", 1)[0] + f"/{db}")
        try:
            for statement in ddl:
                await conn.execute(statement)
            times = []
            bytes0, fpi0 = await wal(conn)
            for rows in batches:
                started = time.perf_counter()
                async with conn.transaction():
                    await conn.copy_records_to_table("stock_movements", records=rows, columns=COLUMNS)
                    if separate_registry:
                        await conn.copy_records_to_table("movement_ids", records=[(r[0],) for r in rows],
                                                         columns=("movement_id",))
                times.append(time.perf_counter() - started)
            bytes1, fpi1 = await wal(conn)
        finally:
            await conn.close()
    finally:
        await admin.execute(f'DROP DATABASE "{db}"')
        await admin.close()
    n = sum(map(len, batches))
    return statistics.median(times), (bytes1 - bytes0) / n, (fpi1 - fpi0) / n


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=10_000)
    args = parser.parse_args()
    now = datetime.now(UTC).replace(microsecond=0)
    today = now.replace(hour=0, minute=0, second=0)
    start = dict.fromkeys(range(PARTITIONS), 0)
    batches = [batch(args.size, start, now) for _ in range(args.batches)]
    results: dict[str, list[tuple[float, float, float]]] = {}
    for round_ in range(args.rounds):
        for name, ddl in layouts(today).items():
            results.setdefault(name, []).append(await run_layout(name, ddl, batches, name.endswith("+registry")))
            print(f"round {round_ + 1} {name}: {results[name][-1][0] * 1000:.1f} ms/batch", flush=True)
    base = statistics.median(r[0] for r in results["today"])
    print(f"\n{args.batches} batches of {args.size} movements, {args.rounds} rounds, medians over rounds")
    print(f"{'layout':<18}{'ms/batch':>10}{'x today':>9}{'WAL B/mvmt':>12}{'FPI/mvmt':>10}")
    for name, rs in results.items():
        ms = statistics.median(r[0] for r in rs)
        print(f"{name:<18}{ms * 1000:>10.1f}{base / ms:>9.2f}{statistics.median(r[1] for r in rs):>12.0f}"
              f"{statistics.median(r[2] for r in rs):>10.3f}")


if __name__ == "__main__":
    asyncio.run(main())
