"""signals: what the warehouse signals (issue 16) cost the ingest path, and what their queries cost on a large ledger.

Each measurement runs in its own scratch database (dropped at the end):

copy     COPY --copy-rows x --repeat movements in transactions of the worker's batch size into two tables shaped
         like `stock_movements` (same constraints and indexes) that already hold --preloaded rows each, one with a
         candidate read index on `(sku, warehouse_id)`; paired batch by batch, alternating which goes first, so
         both see the same background load. No other work: the index's cost is the largest it can be.
levels   the batch transaction's level upsert (`sink._ADD_LEVELS`, one statement per batch of the worker's size)
         on --skus x --warehouses pairs with some going negative: the upsert before issue 16 (no column, no
         index), issue 16's (went_negative_at + a partial index on it) with full pages, the same with fillfactor
         70 (migration 0007: room for HOT updates), and a partial index on `on_hand < 0` (every update non-HOT).
explain  preloads --movements movements with `stock_levels` to match, then EXPLAIN ANALYZEs and times (one warm
         run, JIT off as the CLI runs them) the statements of `stock_ledger.stock` and the negative-stock metric
         query. --keep keeps the database (its name is printed) so the plans can be inspected again.

`signals copy levels` takes about 5 minutes on 2 cores; `signals explain` at 20,000,000 about 15 and ~5 GB of disk.
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from benchkit import BATCH, LEVELS_FROM_MOVEMENTS, Bench, bulk_load, connection, say

from stock_ledger import sink, stock

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

    import asyncpg

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
    "went_negative_at + partial index (0004), full pages": (_FULL_PAGES, sink._ADD_LEVELS),  # noqa: SLF001
    "the same, fillfactor 70 (0007)": ("", sink._ADD_LEVELS),  # noqa: SLF001
    "partial index WHERE on_hand < 0": (
        _FULL_PAGES + _DROP_0004 + "CREATE INDEX stock_levels_lt0_idx ON stock_levels (warehouse_id, sku) "
        "WHERE on_hand < 0", _ADD_LEVELS_BEFORE),
}
# SQL-side generation of movements: the same shape as `movement_rows`, without shipping gigabytes through Python.
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


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    p = add("signals", __doc__, measure)
    p.add_argument("what", nargs="+", choices=("copy", "levels", "explain"))
    p.add_argument("--copy-rows", type=int, default=500_000, help="rows per repetition of copy (default 500,000)")
    p.add_argument("--preloaded", type=int, default=2_000_000, help="rows already in copy's tables (default 2M)")
    p.add_argument("--skus", type=int, default=10_000, help="SKUs (default 10,000)")
    p.add_argument("--warehouses", type=int, default=4, help="warehouses (default 4)")
    p.add_argument("--level-batches", type=int, default=100, help="upsert batches per levels run (default 100)")
    p.add_argument("--movements", type=int, default=20_000_000, help="the ledger of explain (default 20,000,000)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of copy and levels (default 3)")
    p.add_argument("--keep", action="store_true", help="keep the explain database")


async def preload(conn: asyncpg.Connection, table: str, count: int, a: argparse.Namespace, offset: int) -> None:
    await bulk_load(conn, table, _PRELOAD.format(table=table), [
        (a.skus, a.warehouses, offset + lo, min(1_000_000, count - lo)) for lo in range(0, count, 1_000_000)])


def movement_rows(count: int, a: argparse.Namespace, rng: random.Random) -> list[tuple[Any, ...]]:
    """Rows in MOVEMENT_COLUMNS order, SKUs uniformly spread like `stock-ledger produce`."""
    base = datetime(2026, 11, 1, tzinfo=UTC)
    rows = []
    for i in range(count):
        sku, qty = rng.randrange(a.skus), rng.choice((5, 10, 20, -3, -5, -8))
        rows.append((uuid.uuid4(), f"WH-{rng.randrange(a.warehouses):03d}", f"SKU-{sku:06d}", qty,
                     "receipt" if qty > 0 else "pick", base + timedelta(seconds=i), "warehouse.movements", sku % 24,
                     i, base + timedelta(seconds=i)))
    return rows


async def bench_copy(bench: Bench, a: argparse.Namespace) -> dict[str, Any]:
    """The cost is the ratio of the summed times of the paired COPYs."""
    tables = {"without": "bench_copy", "with": "bench_copy_indexed"}
    spent = dict.fromkeys(tables, 0.0)
    await bench.create_database("copy")
    async with bench.owner() as conn:
        for table in tables.values():
            await conn.execute(f"CREATE TABLE {table} (LIKE stock_movements INCLUDING ALL)")
            await preload(conn, table, a.preloaded, a, 10_000_000_000)
        await conn.execute(CANDIDATE_INDEX.format(table=tables["with"]))
        await conn.execute("VACUUM ANALYZE")
        total = a.copy_rows * a.repeat
        rows = movement_rows(total, a, random.Random(1))
        for n, i in enumerate(range(0, total, BATCH)):
            for label in (("without", "with") if n % 2 == 0 else ("with", "without")):
                started = time.perf_counter()
                async with conn.transaction():
                    await conn.copy_records_to_table(tables[label], records=rows[i:i + BATCH],
                                                     columns=sink.MOVEMENT_COLUMNS)
                spent[label] += time.perf_counter() - started
            if (i + BATCH) % 100_000 == 0:
                say(f"copied {i + BATCH:,}/{total:,} into both: without {(i + BATCH) / spent['without']:,.0f}/s, "
                    f"with {(i + BATCH) / spent['with']:,.0f}/s")
    await bench.drop_database(bench.database)
    return {"rows": total, "preloaded": a.preloaded, "skus": a.skus,
            "index": CANDIDATE_INDEX.format(table="bench_copy"), "seconds": spent,
            "rate_without": total / spent["without"], "rate_with": total / spent["with"],
            "cost_percent": 100 * (spent["with"] - spent["without"]) / spent["without"]}


async def levels_once(bench: Bench, label: str, a: argparse.Namespace) -> tuple[float, float]:
    ddl, upsert = _LEVEL_VARIANTS[label]
    await bench.create_database("levels")
    async with bench.owner() as conn:
        if ddl:
            await conn.execute(ddl)
        rng = random.Random(2)
        keys = [(f"WH-{w:03d}", f"SKU-{s:06d}") for w in range(a.warehouses) for s in range(a.skus)]
        # Every pair starts slightly positive and walks randomly (mean-zero deltas): a share of them crosses zero
        # and back, as picks and receipts race.
        await conn.execute(upsert, [k[0] for k in keys], [k[1] for k in keys], [10] * len(keys))
        await conn.execute("VACUUM ANALYZE stock_levels")
        batches = []
        for _ in range(a.level_batches):
            deltas: dict[tuple[str, str], int] = {}
            for _ in range(BATCH):
                key = keys[rng.randrange(len(keys))]
                deltas[key] = deltas.get(key, 0) + rng.choice((5, 10, -5, -10))
            ordered = sorted(deltas)
            batches.append(([k[0] for k in ordered], [k[1] for k in ordered], [deltas[k] for k in ordered]))
        started = time.perf_counter()
        for w, s, d in batches:
            async with conn.transaction():
                await conn.execute(upsert, w, s, d)
        seconds = time.perf_counter() - started
        negative = await conn.fetchval("SELECT count(*) FROM stock_levels WHERE on_hand < 0")
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        hot = await conn.fetchrow("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                                  "WHERE relname = 'stock_levels'")
    await bench.drop_database(bench.database)
    share = hot["n_tup_hot_upd"] / max(1, hot["n_tup_upd"])
    say(f"levels [{label}]: {1000 * seconds / len(batches):.2f} ms per batch, {negative} negative pairs, "
        f"HOT updates {100 * share:.0f} %")
    return seconds / len(batches), share


async def bench_levels(bench: Bench, a: argparse.Namespace) -> dict[str, Any]:
    per_batch: dict[str, list[float]] = {label: [] for label in _LEVEL_VARIANTS}
    hot: dict[str, list[float]] = {label: [] for label in _LEVEL_VARIANTS}
    for r in range(a.repeat):
        n = r % len(_LEVEL_VARIANTS)
        for label in list(_LEVEL_VARIANTS)[n:] + list(_LEVEL_VARIANTS)[:n]:  # rotate who goes first
            seconds, share = await levels_once(bench, label, a)
            per_batch[label].append(seconds)
            hot[label].append(share)
    medians = {label: statistics.median(v) for label, v in per_batch.items()}
    base = medians["before issue 16"]
    return {"pairs": a.skus * a.warehouses, "batches": a.level_batches, "batch": BATCH,
            "ms_per_batch": {k: 1000 * v for k, v in medians.items()},
            "hot_update_share": {k: statistics.median(v) for k, v in hot.items()},
            "cost_percent_of_upsert": {k: 100 * (v - base) / base for k, v in medians.items()}}


def explained_statements(warehouse: str, sku: str, at: datetime) -> list[tuple[str, str, tuple[Any, ...]]]:
    """(label, statement, arguments): what each CLI invocation and the metric run."""
    return [
        ("metric: negative levels (positions timer)", stock.NEGATIVE_TOTALS, ()),
        ("stock show --warehouse W", stock.LEVELS, (warehouse,)),
        ("stock show --warehouse W --sku S", stock.LEVEL, (warehouse, sku)),
        ("stock show --warehouse W --negative", stock.NEGATIVE_LEVELS, (warehouse,)),
        ("stock show --warehouse W --at T", stock.LEVELS_AT, (warehouse, at)),
        ("stock show --warehouse W --sku S --at T", stock.LEVEL_AT, (warehouse, sku, at)),
        ("movements --sku S --limit 100", stock.HISTORY, (sku, None, 100)),
        ("movements --sku S --warehouse W --limit 100", stock.HISTORY_IN_WAREHOUSE, (sku, warehouse, None, 100)),
    ]


async def bench_explain(bench: Bench, a: argparse.Namespace) -> dict[str, Any]:
    name = await bench.create_database("explain")
    results: list[dict[str, Any]] = []
    async with bench.owner() as conn:
        await preload(conn, "stock_movements", a.movements, a, 0)
        await conn.execute(LEVELS_FROM_MOVEMENTS)
        say("stock_levels built; VACUUM ANALYZE")
        await conn.execute("VACUUM ANALYZE")
        size = await conn.fetchval("SELECT pg_size_pretty(pg_total_relation_size('stock_movements'))")
    at = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=a.movements // 2)
    # As `stock show` / `movements` run: without JIT (cli.CLI_SESSION).
    async with connection(bench.owner_url, server_settings={"jit": "off"}) as conn:
        for label, statement, args in explained_statements("WH-001", "SKU-000042", at):
            # EXPLAIN ANALYZE first (it also warms the cache), then one timed run as the CLI would make it.
            plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {statement}", *args))
            started = time.perf_counter()
            await conn.fetch(statement, *args)
            results.append({"query": label, "seconds": time.perf_counter() - started, "plan": plan})
            say(f"{label}: {results[-1]['seconds']:.3f} s")
    if a.keep:
        bench.databases.remove(name)  # not dropped by bench.close
        say(f"kept database {name}")
    return {"movements": a.movements, "table_size": size, "queries": results}


async def measure(bench: Bench, a: argparse.Namespace) -> str:
    run = {"copy": bench_copy, "levels": bench_levels, "explain": bench_explain}
    for what in a.what:
        bench.results[what] = await run[what](bench, a)
    lines = []
    if copy := bench.results.get("copy"):
        lines += [(f"COPY {copy['rows']:,} movements into a table of {copy['preloaded']:,} ({copy['skus']:,} "
                   f"SKUs), batches of {BATCH}, paired:"),
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
