"""The online upgrade to segments (migration 0014) on a ledger of --rows movements, with a writer inserting all along.

A scratch database migrated as the previous release left it (0001-0013), filled with --rows movements over 24 Kafka
partitions; then `migrate` (0014 and on) runs while a writer inserts a batch of 24 movements every 10 ms as the
previous release's worker does (one INSERT into stock_movements, so the mirror trigger and the swap's lock are
met). Reported: each step's duration (from migrate's own log), the writer's insert latencies (median, p99, max, how
many took over 1 s), the rows written meanwhile, and that every movement is in the new table exactly once.

  python docs/bench/archive-2026-12-03/upgrade_20m.py --rows 20000000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
import structlog

import stock_ledger.migrate as migrations
from stock_ledger.migrate import find_migrations_dir, migrate

ADMIN = "postgresql://stock_ledger:stock_ledger@127.0.0.1:5432/stock_ledger"
FILL = """
INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                             kafka_offset)
SELECT gen_random_uuid(), 'WH-' || (i % 4), 'SKU-' || (i % 10000), 1, 'receipt', now(), 'old', i % 24, i / 24
  FROM generate_series($1::bigint, $2::bigint - 1) AS i
"""
WRITE = """
INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                             kafka_offset)
SELECT id, 'WH-2', 'SKU-X', 1, 'receipt', now(), 'old', p, $2 FROM unnest($1::uuid[], $3::int[]) AS u(id, p)
"""


def _steps(events: list[dict[str, object]]) -> list[tuple[str, object]]:
    """(migration/step, seconds) from migrate's own log lines, in order."""
    return [(f"{e['migration']}/{e['step']}", e["seconds"]) for e in events if e.get("event") == "migration.step_done"]


async def main(rows: int) -> dict[str, object]:
    name = f"upgrade_{int(time.time())}"
    admin = await asyncpg.connect(ADMIN)
    await admin.execute(f"CREATE DATABASE {name}")
    url = ADMIN.rsplit("/", 1)[0] + f"/{name}"
    events: list[dict[str, object]] = []

    def keep(_: object, __: str, event: dict[str, object]) -> dict[str, object]:
        events.append(event | {"at": time.monotonic()})
        return event

    structlog.configure(processors=[keep, structlog.processors.JSONRenderer()],
                        logger_factory=structlog.ReturnLoggerFactory())
    logging.disable(logging.CRITICAL)
    try:
        old = Path(tempfile.mkdtemp())
        for path in sorted(find_migrations_dir(None).glob("00*.sql")):
            if int(path.name[:4]) <= 13:
                shutil.copy(path, old / path.name)
        migrations.SCHEMA_VERSION = 13  # type: ignore[misc]
        await migrate(url, old)
        migrations.SCHEMA_VERSION = 15  # type: ignore[misc]
        owner = await asyncpg.connect(url)
        started = time.monotonic()
        for lo in range(0, rows, 1_000_000):
            await owner.execute(FILL, lo, min(rows, lo + 1_000_000))
        await owner.execute("VACUUM ANALYZE stock_movements")
        loaded = time.monotonic() - started
        writer = await asyncpg.connect(url)
        stop = asyncio.Event()
        latencies: list[float] = []

        async def previous_release() -> None:
            offset = rows // 24 + 10
            while not stop.is_set():
                t = time.monotonic()
                await writer.execute(WRITE, [uuid.uuid4() for _ in range(24)], offset, list(range(24)))
                latencies.append(time.monotonic() - t)
                offset += 1
                await asyncio.sleep(0.01)

        writing = asyncio.create_task(previous_release())
        await asyncio.sleep(1)
        t = time.monotonic()
        applied = await migrate(url, find_migrations_dir(None))
        took = time.monotonic() - t
        await asyncio.sleep(1)
        stop.set()
        await writing
        await writer.close()
        total = rows + 24 * len(latencies)
        exact = (await owner.fetchval("SELECT count(*) FROM stock_movements") == total
                 and await owner.fetchval("SELECT count(*) FROM movement_ids") == total)
        await owner.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
    ordered = sorted(latencies)
    return {
        "rows": rows, "load_s": round(loaded), "applied": applied, "migrate_s": round(took, 1), "steps": _steps(events),
        "writer_inserts": len(latencies), "insert_median_ms": round(1000 * statistics.median(ordered), 1),
        "insert_p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1),
        "insert_max_s": round(ordered[-1], 2), "inserts_over_1s": sum(x > 1 for x in ordered),
        "every_row_once": exact,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000_000)
    print(json.dumps(asyncio.run(main(parser.parse_args().rows))))
