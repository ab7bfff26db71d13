"""How fast one segment is archived, and with how much memory: a scratch ledger (all migrations) with one segment of
N movements (10,000 SKUs, 4 warehouses, random ids), archived by the code `stock-ledger archive run` runs for each
segment (archive/run.py `archive_segment`: rows to Parquet, read back and summed, summed again in PostgreSQL under
the lock, recorded and detached, dropped). Prints rows, seconds, movements/s, bytes per movement and the process's
peak RSS. Kafka is not involved (the choice of segments is not timed).

  python docs/bench/archive-2026-12-03/archive_speed.py --rows 2000000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
import time
from pathlib import Path

import asyncpg

from stock_ledger.archive import run as archival
from stock_ledger.config import load_settings
from stock_ledger.ledger import archives, pgtime
from stock_ledger.migrate import find_migrations_dir, migrate

ADMIN = "postgresql://stock_ledger:stock_ledger@127.0.0.1:5432/stock_ledger"
FILL = """
INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                             kafka_offset, kafka_timestamp)
SELECT gen_random_uuid(), 'WH-' || (o % 4), 'SKU-' || (o % 10000), (o % 9) + 1, 'receipt',
       timestamptz '2026-01-01' + o * interval '10 ms', 'warehouse.movements', 0, o, now()
  FROM generate_series($1::bigint, $2::bigint - 1) AS o
"""


async def main(rows: int) -> dict[str, object]:
    name = f"archive_speed_{int(time.time())}"
    admin = await asyncpg.connect(ADMIN)
    await admin.execute(f"CREATE DATABASE {name}")
    url = ADMIN.rsplit("/", 1)[0] + f"/{name}"
    try:
        await migrate(url, find_migrations_dir(None))
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("UPDATE ledger_layout SET segment_offsets = $1", rows)
            await conn.fetch("SELECT * FROM stock_ledger_ensure_segments(ARRAY[0], ARRAY[1::bigint])")
            for lo in range(0, rows, 500_000):
                await conn.execute(FILL, lo, min(rows, lo + 500_000))
            await conn.execute("VACUUM ANALYZE stock_movements")
            await pgtime.install(conn)
            (segment,) = [s for s in await archives.segments(conn) if s.first_offset == 0]
            with tempfile.TemporaryDirectory() as directory:
                settings = load_settings({"DATABASE_URL": url, "STOCK_LEDGER_ARCHIVE_DIR": directory,
                                          "STOCK_LEDGER_RETENTION_DAYS": "0"})
                started = time.perf_counter()
                manifest = await archival.archive_segment(conn, settings, Path(directory), segment)
                seconds = time.perf_counter() - started
        finally:
            await conn.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
    return {"rows": manifest.summary.rows, "seconds": round(seconds, 1),
            "movements_per_second": round(manifest.summary.rows / seconds),
            "bytes_per_movement": round(manifest.bytes / manifest.summary.rows, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000)
    print(json.dumps(asyncio.run(main(parser.parse_args().rows))))
