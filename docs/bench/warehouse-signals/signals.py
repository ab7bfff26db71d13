"""Issue 16's experiments: what the warehouse signals cost the ingest path, and their queries on a large ledger.

copy: COPY into copies of `stock_movements` with and without a (sku, warehouse_id) index, paired; levels: the level
upsert before issue 16, with went_negative_at (full pages, fillfactor 70), with an index on `on_hand < 0`; explain:
`stock_ledger.ledger.stock`'s statements on --movements. docs/performance.md, "Warehouse signals".

They decided three things once (no such index, fillfactor 70 on `stock_levels`, reads by a sequential scan) against
code pasted from before them, so they live beside their evidence rather than in `python -m scripts.bench`, whose
kit they use. From the repository root (`PYTHONPATH=.`: the kit and the tests' service discovery):

    PYTHONPATH=. .venv/bin/python docs/bench/warehouse-signals/signals.py levels [--repeat 3] [--out FILE]
"""

import argparse
import json
import random
import statistics
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final

import asyncpg
import uvloop
from scripts import bench as tool
from scripts import benchkit as kit

from stock_ledger.ledger import pgtime, stock
from stock_ledger.ledger.batch import MOVEMENT_COLUMNS, Record, build_batch
from stock_ledger.ledger.movements import _ADD_LEVELS as ADD_LEVELS  # the batch's own upsert, measured
from stock_ledger.produce import movements

CANDIDATE_INDEX: Final = "CREATE INDEX {table}_sku_idx ON {table} (sku, warehouse_id)"
# The upsert as it was before issue 16 (git show 3f57abb:src/stock_ledger/sink.py).
_ADD_LEVELS_BEFORE: Final = """
INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand)
SELECT w, s, d FROM unnest($1::text[], $2::text[], $3::bigint[]) AS t(w, s, d) ORDER BY w, s
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + EXCLUDED.on_hand, updated_at = now()
"""
_DROP_0004: Final = ("ALTER TABLE stock_levels DROP CONSTRAINT stock_levels_went_negative_at_check; "
                     "DROP INDEX stock_levels_negative_idx; ALTER TABLE stock_levels DROP COLUMN went_negative_at;")
_FULL_PAGES: Final = "ALTER TABLE stock_levels SET (fillfactor = 100);"  # as before migration 0007
_LEVEL_VARIANTS: Final = {  # label -> (DDL after the migrations, upsert)
    "before issue 16": (_FULL_PAGES + _DROP_0004, _ADD_LEVELS_BEFORE),
    "went_negative_at + partial index (0004), full pages": (_FULL_PAGES, ADD_LEVELS),
    "the same, fillfactor 70 (0007)": ("", ADD_LEVELS),
    "partial index WHERE on_hand < 0": (
        _FULL_PAGES + _DROP_0004 + "CREATE INDEX stock_levels_lt0_idx ON stock_levels (warehouse_id, sku) "
        "WHERE on_hand < 0", _ADD_LEVELS_BEFORE),
}
# Movements generated server-side (random ids, --skus and --warehouses), not shipped through Python by the GB.
_PRELOAD: Final = """
INSERT INTO {table} (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                     kafka_offset, kafka_timestamp)
SELECT gen_random_uuid(), 'WH-' || lpad((h % $2::int)::text, 3, '0'), 'SKU-' || lpad((k % $1::int)::text, 6, '0'),
       q, CASE WHEN q > 0 THEN 'receipt' ELSE 'pick' END,
       timestamptz '2026-01-01 00:00+00' + i * interval '1 second', 'warehouse.movements', (k % $1::int) % 24,
       $3::bigint + i, timestamptz '2026-01-01 00:00+00' + i * interval '1 second'
  FROM generate_series(1, $4::bigint) AS i,
       LATERAL (SELECT hashint8(i) AS h, abs(hashint8(-i)) AS k,
                       (ARRAY[5, 10, 20, -3, -5, -9])[1 + abs(hashint8(i * 7)) % 6] AS q) AS r
"""


async def preload(conn: asyncpg.Connection, table: str, count: int, a: argparse.Namespace, offset: int) -> None:
    await kit.bulk_load(conn, table, _PRELOAD.format(table=table), [
        (a.skus, a.warehouses, offset + lo, min(1_000_000, count - lo)) for lo in range(0, count, 1_000_000)])


async def bench_copy(bench: kit.Bench, a: argparse.Namespace) -> dict[str, Any]:
    """The cost is the ratio of the summed times of the paired COPYs."""
    tables, total = {"without": "bench_copy", "with": "bench_copy_indexed"}, a.copy_rows * a.repeat
    spent = dict.fromkeys(tables, 0.0)
    await bench.create_database("copy")
    async with bench.owner() as conn:
        for table in tables.values():
            await conn.execute(f"CREATE TABLE {table} (LIKE stock_movements INCLUDING ALL)")
            # An index of today's layout left out of both tables, so that the candidate is measured on its own.
            for (name,) in await conn.fetch("SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = "
                                            "$1::regclass AND strpos(pg_get_indexdef(indexrelid), $2) > 0",
                                            table, a.drop_like) if a.drop_like else ():
                await conn.execute(f"DROP INDEX {name}")
            await preload(conn, table, a.preloaded, a, 10_000_000_000)
        await conn.execute(a.index.format(table=tables["with"]))
        await conn.execute("VACUUM ANALYZE")
        await pgtime.install(conn)
        records: dict[int, list[Record]] = {}  # `stock-ledger produce`'s movements, built as the worker builds them
        late = round(1 / a.late_share) if a.late_share else 0
        for i, (key, value) in enumerate(movements(total, a.skus, a.warehouses, seed=1)):
            # --late-share: each record's timestamp 2 s after its movement, one in 1/F a day after (out of step).
            stamp = 1_790_000_000_000
            if a.late_share is not None:
                occurred = datetime.fromisoformat(json.loads(value)["occurred_at"])
                stamp = int(occurred.timestamp() * 1000) + 2_000 + (86_400_000 if late and i % late == 0 else 0)
            records.setdefault(p := i % kit.PARTITIONS, []).append(Record(p, i, stamp, key, value))
        rows = build_batch("warehouse.movements", records, dict.fromkeys(records, 1)).movements
        for n, i in enumerate(range(0, total, kit.BATCH)):
            for label in ("without", "with") if n % 2 == 0 else ("with", "without"):
                started = time.perf_counter()
                async with conn.transaction():
                    await conn.copy_records_to_table(tables[label], records=rows[i:i + kit.BATCH],
                                                     columns=MOVEMENT_COLUMNS)
                spent[label] += time.perf_counter() - started
            if (done := i + kit.BATCH) % 100_000 == 0:
                kit.say(f"copied {done:,}/{total:,}: {spent['with'] / spent['without'] - 1:+.1%} with the index")
    await bench.drop_database(bench.database)
    return {"rows": total, "preloaded": a.preloaded, "skus": a.skus,
            "index": a.index.format(table="bench_copy"), "seconds": spent,
            "rate_without": total / spent["without"], "rate_with": total / spent["with"],
            "cost_percent": 100 * (spent["with"] - spent["without"]) / spent["without"]}


async def levels_once(bench: kit.Bench, label: str, a: argparse.Namespace) -> tuple[float, float]:
    ddl, upsert = _LEVEL_VARIANTS[label]
    rng, keys = random.Random(2), [(f"WH-{w:03d}", f"SKU-{s:06d}") for w in range(a.warehouses) for s in range(a.skus)]
    await bench.create_database("levels")
    async with bench.owner() as conn:
        if ddl:
            await conn.execute(ddl)
        # Every pair starts at 10 and walks randomly: some cross zero and back, as picks and receipts race.
        await conn.execute(upsert, [k[0] for k in keys], [k[1] for k in keys], [10] * len(keys))
        await conn.execute("VACUUM ANALYZE stock_levels")
        batches = []
        for _ in range(a.level_batches):
            deltas: dict[tuple[str, str], int] = {}
            for key in (keys[rng.randrange(len(keys))] for _ in range(kit.BATCH)):
                deltas[key] = deltas.get(key, 0) + rng.choice((5, 10, -5, -10))
            ordered = sorted(deltas)
            batches.append(([k[0] for k in ordered], [k[1] for k in ordered], [deltas[k] for k in ordered]))
        started = time.perf_counter()
        for w, s, d in batches:
            async with conn.transaction():
                await conn.execute(upsert, w, s, d)
        seconds = (time.perf_counter() - started) / len(batches)
        negative = await conn.fetchval("SELECT count(*) FROM stock_levels WHERE on_hand < 0")
        await conn.execute("SELECT pg_stat_force_next_flush(); SELECT pg_stat_clear_snapshot()")
        share = await conn.fetchval("SELECT n_tup_hot_upd::float8 / greatest(1, n_tup_upd) FROM pg_stat_user_tables "
                                    "WHERE relname = 'stock_levels'")
    await bench.drop_database(bench.database)
    kit.say(f"levels [{label}]: {1000 * seconds:.2f} ms per batch, {negative} negative pairs, HOT {100 * share:.0f} %")
    return seconds, share


async def bench_levels(bench: kit.Bench, a: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[tuple[float, float]]] = {label: [] for label in _LEVEL_VARIANTS}
    for r in range(a.repeat):
        n = r % len(runs)
        for label in list(runs)[n:] + list(runs)[:n]:  # rotate who goes first
            runs[label].append(await levels_once(bench, label, a))
    seconds = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
    base = seconds["before issue 16"]
    return {"pairs": a.skus * a.warehouses, "batches": a.level_batches, "batch": kit.BATCH,
            "ms_per_batch": {k: 1000 * v for k, v in seconds.items()},
            "hot_update_share": {k: statistics.median(h for _, h in v) for k, v in runs.items()},
            "cost_percent_of_upsert": {k: 100 * (v - base) / base for k, v in seconds.items()}}


async def bench_explain(bench: kit.Bench, a: argparse.Namespace) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    await bench.create_database("explain")
    async with bench.owner() as conn:
        await preload(conn, "stock_movements", a.movements, a, 0)
        await conn.execute(kit.LEVELS_FROM_MOVEMENTS)
        await conn.execute("VACUUM ANALYZE")
        size = await conn.fetchval("SELECT pg_size_pretty(pg_total_relation_size('stock_movements'))")
    w, s, at = "WH-001", "SKU-000042", datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=a.movements // 2)
    async with bench.owner(server_settings={"jit": "off"}) as conn:  # as `stock show` / `movements` run
        for label, statement, args in [
            ("metric: negative levels (positions timer)", stock.NEGATIVE_TOTALS, ()),
            ("stock show --warehouse W", stock.LEVELS, (w,)),
            ("stock show --warehouse W --sku S", stock.LEVEL, (w, s)),
            ("stock show --warehouse W --negative", stock.NEGATIVE_LEVELS, (w,)),
            ("stock show --warehouse W --at T", stock.FORWARD_AT, (w, at)),
            ("stock show --warehouse W --sku S --at T", stock.FORWARD_AT_SKU, (w, at, s)),
            ("movements --sku S --limit 100", stock.HISTORY, (s, None, 100)),
            ("movements --sku S --warehouse W --limit 100", stock.HISTORY_IN_WAREHOUSE, (s, w, None, 100)),
        ]:
            # EXPLAIN ANALYZE first (it also warms the cache), then one timed run as the CLI would make it.
            plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {statement}", *args))
            started = time.perf_counter()
            await conn.fetch(statement, *args)
            results.append({"query": label, "seconds": time.perf_counter() - started, "plan": plan})
            kit.say(f"{label}: {results[-1]['seconds']:.3f} s")
    return {"movements": a.movements, "table_size": size, "queries": results}


async def measure(bench: kit.Bench, a: argparse.Namespace) -> str:
    run = {"copy": bench_copy, "levels": bench_levels, "explain": bench_explain}
    for what in a.what:
        bench.results[what] = await run[what](bench, a)
    lines = []
    if copy := bench.results.get("copy"):
        lines += [(f"COPY {copy['rows']:,} movements into a table of {copy['preloaded']:,} ({copy['skus']:,} "
                   f"SKUs), batches of {kit.BATCH}, paired:"),
                  f"  without the index: {copy['rate_without']:,.0f}/s",
                  f"  with `{copy['index']}`: {copy['rate_with']:,.0f}/s  (cost {copy['cost_percent']:+.1f} %)"]
    if levels := bench.results.get("levels"):
        lines.append(f"level upsert, {levels['pairs']:,} pairs, {levels['batches']} batches of {levels['batch']}:")
        lines += [f"  {label}: {ms:.2f} ms/batch ({levels['cost_percent_of_upsert'][label]:+.1f} %), HOT updates "
                  f"{100 * levels['hot_update_share'][label]:.0f} %" for label, ms in levels["ms_per_batch"].items()]
    if explain := bench.results.get("explain"):
        lines.append(f"queries on {explain['movements']:,} movements ({explain['table_size']}), warm:")
        lines += [f"  {q['query']}: {q['seconds'] * 1000:,.1f} ms" for q in explain["queries"]]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="docs/bench/warehouse-signals/signals.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="+", choices=("copy", "levels", "explain"))
    p.add_argument("--out", type=Path, help="JSON results (default bench-results/signals-<time>.json)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; medians (default %(default)s)")
    p.add_argument("--copy-rows", type=int, default=500_000, help="rows per repetition of copy (default %(default)s)")
    p.add_argument("--preloaded", type=int, default=2_000_000, help="rows in copy's tables (default %(default)s)")
    p.add_argument("--skus", type=int, default=10_000, help="SKUs (default %(default)s)")
    p.add_argument("--warehouses", type=int, default=4, help="warehouses (default %(default)s)")
    p.add_argument("--level-batches", type=int, default=100, help="upserts per levels run (default %(default)s)")
    p.add_argument("--movements", type=int, default=20_000_000, help="the ledger of explain (default %(default)s)")
    p.add_argument("--index", default=CANDIDATE_INDEX, help="copy's candidate index, {table} for the table "
                   "(default %(default)r)")
    p.add_argument("--drop-like", metavar="TEXT", help="copy: drop the indexes of today's layout whose definition "
                   "holds TEXT from both tables first (to measure one of them as the candidate)")
    p.add_argument("--late-share", type=float, metavar="F", help="copy: each record's Kafka timestamp 2 s after its "
                   "movement and a share F a day after (default: one fixed timestamp for all)")
    p.set_defaults(command="signals", measure=measure)
    return p


if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(uvloop.run(tool.main(parser().parse_args(argv), " ".join([sys.argv[0], *argv]))))
