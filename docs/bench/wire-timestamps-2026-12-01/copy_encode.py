# ruff: noqa: INP001 - a measurement kept beside its results, not a package
"""Client CPU of asyncpg's COPY encoding per row, by timestamp form (the figures behind README, "Less work inside
the transaction"). Run from the repository root with the project's services up:

    .venv/bin/python docs/bench/wire-timestamps-2026-12-01/copy_encode.py

100,000 movement rows from `stock_ledger.produce.movements`, COPY'd in batches of 5,000 into a temporary table with
the ledger's column types, five times per form; prints the median client CPU (process time) per row. The server's
time is not in it. Then the CPU of summing one batch's stock level deltas (median of 30)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
from localservices import discover  # noqa: E402

from stock_ledger import pgtime  # noqa: E402
from stock_ledger.batch import (  # noqa: E402
    M_KAFKA_TS,
    M_OCCURRED_AT,
    MOVEMENT_COLUMNS,
    Record,
    build_batch,
    level_deltas,
)
from stock_ledger.produce import movements  # noqa: E402

N, BATCH, REPEAT = 100_000, 5_000, 5
TABLE = """CREATE TEMP TABLE t (movement_id uuid, warehouse_id text, sku text, qty int, kind text,
    occurred_at timestamptz, kafka_topic text, kafka_partition int, kafka_offset bigint, kafka_timestamp timestamptz)"""


def as_datetime(wire: tuple[int] | None) -> object:
    return None if wire is None else pgtime.PG_EPOCH + wire[0] * pgtime.MICROSECOND


async def cpu_per_row(conn: asyncpg.Connection, rows: list[tuple[object, ...]]) -> float:
    spent = []
    for _ in range(REPEAT):
        await conn.execute("TRUNCATE t")
        started = time.process_time()
        for i in range(0, len(rows), BATCH):
            await conn.copy_records_to_table("t", records=rows[i:i + BATCH], columns=MOVEMENT_COLUMNS)
        spent.append(time.process_time() - started)
    return statistics.median(spent) / len(rows) * 1e6


async def main() -> None:
    records = [Record(i % 24, i, 1_764_600_000_000 + i // 3, k, v) for i, (k, v) in enumerate(movements(N))]
    by_partition: dict[int, list[Record]] = {}
    for r in records:
        by_partition.setdefault(r.partition, []).append(r)
    wire = build_batch("warehouse.movements", by_partition, dict.fromkeys(by_partition, 1)).movements
    datetimes = [(*m[:M_OCCURRED_AT], as_datetime(m[M_OCCURRED_AT]), *m[M_OCCURRED_AT + 1:M_KAFKA_TS],
                  as_datetime(m[M_KAFKA_TS])) for m in wire]
    untimed = [(*m[:M_OCCURRED_AT], None, *m[M_OCCURRED_AT + 1:M_KAFKA_TS], None) for m in wire]
    url = discover().admin_url
    plain, installed = await asyncpg.connect(url), await asyncpg.connect(url)
    try:
        await pgtime.install(installed)
        for c in (plain, installed):
            await c.execute(TABLE)
        print(f"datetimes, asyncpg's codec:   {await cpu_per_row(plain, datetimes):.2f} µs per row")
        print(f"wire form, pgtime's codec:    {await cpu_per_row(installed, wire):.2f} µs per row")
        print(f"no timestamps (NULL):         {await cpu_per_row(plain, untimed):.2f} µs per row")
        spent = []
        for _ in range(30):
            started = time.process_time()
            level_deltas(wire[:BATCH])
            spent.append(time.process_time() - started)
        print(f"level deltas of {BATCH:,} rows: {statistics.median(spent) * 1e3:.2f} ms")
    finally:
        await plain.close()
        await installed.close()


asyncio.run(main())
