"""What the warehouse signals (issue 16) cost the ingest path, and what their queries cost on a large ledger.

Three measurements, each in its own scratch database (dropped at the end), on the local PostgreSQL:

1. copy     COPY M x R movements (default 500,000 x 3) in transactions of the worker's batch size into two tables
            shaped like `stock_movements` (same constraints and indexes) that already hold P rows each (default
            2,000,000), one with a candidate read index on `(sku, warehouse_id)`; paired batch by batch.
            Each COPY transaction commits (one WAL flush), like a batch; no other work, so this is the ingest
            path's physical limit and the index's cost is the largest it can be relative to it.
2. levels   the batch transaction's level upsert (`sink._ADD_LEVELS`, one statement per batch of the worker's
            size) on K (warehouse, sku) pairs with some going negative: the upsert before issue 16 (no column, no
            index), issue 16's (went_negative_at + a partial index on it) with full pages, the same with
            fillfactor 70 (migration 0007: room for HOT updates on each page), and the partial index on
            `on_hand < 0` (which makes every level update a non-HOT update).
3. explain  preloads N movements (default 20,000,000) with `stock_levels` to match, then EXPLAIN ANALYZEs and times
            (one warm run) the statements of `stock_ledger.stock` and the negative-stock metric query. The database
            is kept when `--keep` is given (its name is printed) so the plans can be inspected again.

    .venv/bin/python scripts/bench_signals.py copy levels            # about 5 minutes on 2 cores
    .venv/bin/python scripts/bench_signals.py explain --movements 20000000   # about 15 minutes, ~5 GB of disk

Results go to stdout as a table and to `bench-results/signals-<time>.json`. Services: DATABASE_URL if set, else
`scripts/postgres.sh url` (the URL must be allowed to CREATE DATABASE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import asyncpg

from stock_ledger import sink, stock
from stock_ledger.config import Settings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling harness, run as a script or imported
from localservices import create_migrated_database, drop_database, script_output, url_for

if TYPE_CHECKING:
    from collections.abc import Sequence

ROOT: Final = Path(__file__).resolve().parents[1]
BATCH: Final = Settings().batch_max_records
CANDIDATE_INDEX: Final = "CREATE INDEX bench_copy_sku_idx ON bench_copy (sku, warehouse_id)"
_STARTED: Final = time.monotonic()
# The upsert as it was before issue 16 (git show 3f57abb:src/stock_ledger/sink.py).
_ADD_LEVELS_BEFORE: Final = """
INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand)
SELECT w, s, d FROM unnest($1::text[], $2::text[], $3::bigint[]) AS t(w, s, d) ORDER BY w, s
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + EXCLUDED.on_hand, updated_at = now()
"""


def say(message: str) -> None:
    print(f"[bench-signals {time.monotonic() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def admin_url() -> str:
    return os.environ.get("DATABASE_URL") or script_output("postgres.sh", "url")


async def scratch_database(admin: str, label: str) -> tuple[str, str]:
    """A new migrated database for one measurement: its name and owner URL."""
    name = f"bench_signals_{label}_{uuid.uuid4().hex[:8]}"
    return name, await create_migrated_database(admin, name)


def movement_rows(count: int, skus: int, warehouses: int, first_offset: int,
                  rng: random.Random) -> list[tuple[Any, ...]]:
    """Rows in MOVEMENT_COLUMNS order, SKUs uniformly spread like `stock-ledger produce`."""
    base = datetime(2026, 11, 1, tzinfo=UTC)
    rows = []
    for i in range(count):
        sku = rng.randrange(skus)
        qty = rng.choice((5, 10, 20, -3, -5, -8))
        rows.append((uuid.uuid4(), f"WH-{rng.randrange(warehouses):03d}", f"SKU-{sku:06d}", qty,
                     "receipt" if qty > 0 else "pick", base + timedelta(seconds=first_offset + i),
                     "warehouse.movements", sku % 24, first_offset + i, base + timedelta(seconds=first_offset + i)))
    return rows


# SQL-side generation of P (or N) movements: the same shape, without shipping gigabytes through Python.
_PRELOAD: Final = """
INSERT INTO {table} (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                     kafka_offset, kafka_timestamp)
SELECT gen_random_uuid(), 'WH-' || lpad((h % {warehouses})::text, 3, '0'), 'SKU-' || lpad((k % {skus})::text, 6, '0'),
       q, CASE WHEN q > 0 THEN 'receipt' ELSE 'pick' END,
       timestamptz '2026-01-01 00:00+00' + i * interval '1 second', 'warehouse.movements', (k % {skus}) % 24,
       {offset} + i, timestamptz '2026-01-01 00:00+00' + i * interval '1 second'
  FROM generate_series(1, {count}) AS i,
       LATERAL (SELECT hashint8(i) AS h, abs(hashint8(-i)) AS k,
                       (ARRAY[5, 10, 20, -3, -5, -9])[1 + abs(hashint8(i * 7)) % 6] AS q) AS r
"""


async def preload(conn: asyncpg.Connection, table: str, count: int, *, skus: int, warehouses: int,  # noqa: PLR0913
                  offset: int) -> None:
    """Bulk rows with the table's unique constraints dropped, then rebuilt by sort: several times faster than
    maintaining them row by row."""
    constraints = await conn.fetch(
        "SELECT conname, pg_get_constraintdef(oid) AS definition FROM pg_constraint "
        "WHERE conrelid = $1::regclass AND contype = 'u'", table)
    for c in constraints:
        await conn.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{c["conname"]}"')
    chunk = 1_000_000
    for start in range(0, count, chunk):
        n = min(chunk, count - start)
        await conn.execute(_PRELOAD.format(table=table, count=n, skus=skus, warehouses=warehouses,
                                           offset=offset + start))
        say(f"preloaded {start + n:,}/{count:,} into {table}")
    for c in constraints:
        await conn.execute(f'ALTER TABLE {table} ADD CONSTRAINT "{c["conname"]}" {c["definition"]}')
    say(f"rebuilt the unique constraints of {table}")


async def bench_copy(admin: str, opts: argparse.Namespace) -> dict[str, Any]:
    """A paired measurement, robust to a machine shared with other work: two identically preloaded tables, one
    with the candidate index; each batch is COPY'd into both, back to back, alternating which goes first, so
    both see the same background load. The cost is the ratio of the summed times."""
    name, url = await scratch_database(admin, "copy")
    tables = {"without": "bench_copy", "with": "bench_copy_indexed"}
    spent = dict.fromkeys(tables, 0.0)
    conn = await asyncpg.connect(url)
    try:
        for table in tables.values():
            await conn.execute(f"CREATE TABLE {table} (LIKE stock_movements INCLUDING ALL)")
            await preload(conn, table, opts.preloaded, skus=opts.skus, warehouses=opts.warehouses,
                          offset=10_000_000_000)
        await conn.execute(CANDIDATE_INDEX.replace("bench_copy", tables["with"]))
        await conn.execute("VACUUM ANALYZE")
        total = opts.copy_rows * opts.repeat
        rows = movement_rows(total, opts.skus, opts.warehouses, 0, random.Random(1))
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
    finally:
        await conn.close()
        await drop_database(admin, name)
    return {"rows": total, "preloaded": opts.preloaded, "skus": opts.skus, "index": CANDIDATE_INDEX,
            "seconds": spent, "rate_without": total / spent["without"], "rate_with": total / spent["with"],
            "cost_percent": 100 * (spent["with"] - spent["without"]) / spent["without"]}


_DROP_0004: Final = ("ALTER TABLE stock_levels DROP CONSTRAINT stock_levels_went_negative_at_check; "
                     "DROP INDEX stock_levels_negative_idx; ALTER TABLE stock_levels DROP COLUMN went_negative_at;")
_FULL_PAGES: Final = "ALTER TABLE stock_levels SET (fillfactor = 100);"  # as before migration 0007
_LEVEL_VARIANTS: Final = {
    # label -> (DDL after migration 0004, upsert)
    "before issue 16": (_FULL_PAGES + _DROP_0004, _ADD_LEVELS_BEFORE),
    "went_negative_at + partial index (0004), full pages": (_FULL_PAGES, sink._ADD_LEVELS),  # noqa: SLF001
    "the same, fillfactor 70 (0007)": ("", sink._ADD_LEVELS),  # noqa: SLF001
    "partial index WHERE on_hand < 0": (
        _FULL_PAGES + _DROP_0004
        + "CREATE INDEX stock_levels_lt0_idx ON stock_levels (warehouse_id, sku) WHERE on_hand < 0",
        _ADD_LEVELS_BEFORE,
    ),
}


async def levels_once(admin: str, label: str, opts: argparse.Namespace) -> tuple[float, float]:
    ddl, upsert = _LEVEL_VARIANTS[label]
    name, url = await scratch_database(admin, "levels")
    conn = await asyncpg.connect(url)
    try:
        if ddl:
            await conn.execute(ddl)
        rng = random.Random(2)
        keys = [(f"WH-{w:03d}", f"SKU-{s:06d}") for w in range(opts.warehouses) for s in range(opts.skus)]
        # Every pair starts slightly positive and walks randomly (mean-zero deltas): a share of them crosses zero
        # and back, as picks and receipts race.
        await conn.execute(upsert, [k[0] for k in keys], [k[1] for k in keys], [10] * len(keys))
        await conn.execute("VACUUM ANALYZE stock_levels")
        batches = []
        for _ in range(opts.level_batches):
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
        share = hot["n_tup_hot_upd"] / max(1, hot["n_tup_upd"])
        say(f"levels [{label}]: {1000 * seconds / len(batches):.2f} ms per batch, {negative} negative pairs, "
            f"HOT updates {100 * share:.0f} %")
        return seconds / len(batches), share
    finally:
        await conn.close()
        await drop_database(admin, name)


async def bench_levels(admin: str, opts: argparse.Namespace) -> dict[str, Any]:
    per_batch: dict[str, list[float]] = {label: [] for label in _LEVEL_VARIANTS}
    hot: dict[str, list[float]] = {label: [] for label in _LEVEL_VARIANTS}
    for r in range(opts.repeat):
        n = r % len(_LEVEL_VARIANTS)
        for label in list(_LEVEL_VARIANTS)[n:] + list(_LEVEL_VARIANTS)[:n]:  # rotate who goes first
            seconds, share = await levels_once(admin, label, opts)
            per_batch[label].append(seconds)
            hot[label].append(share)
    medians = {label: statistics.median(v) for label, v in per_batch.items()}
    base = medians["before issue 16"]
    return {"pairs": opts.skus * opts.warehouses, "batches": opts.level_batches, "batch": BATCH,
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


async def bench_explain(admin: str, opts: argparse.Namespace) -> dict[str, Any]:
    reuse = opts.database is not None  # a database kept by an earlier --keep run: no preload
    name, url = (opts.database, url_for(admin, opts.database)) if reuse else await scratch_database(admin, "explain")
    # As `stock show` / `movements` run: without JIT (cli.CLI_SESSION), unless --jit.
    conn = await asyncpg.connect(url, server_settings=None if opts.jit else {"jit": "off"})
    results: list[dict[str, Any]] = []
    try:
        if not reuse:
            await preload(conn, "stock_movements", opts.movements, skus=opts.skus, warehouses=opts.warehouses,
                          offset=0)
            await conn.execute("""
                INSERT INTO stock_levels (warehouse_id, sku, on_hand, went_negative_at)
                SELECT warehouse_id, sku, sum(qty), CASE WHEN sum(qty) < 0 THEN now() END
                  FROM stock_movements GROUP BY 1, 2""")
            say("stock_levels built; VACUUM ANALYZE")
            await conn.execute("VACUUM ANALYZE")
        movements = await conn.fetchval("SELECT count(*) FROM stock_movements") if reuse else opts.movements
        size = await conn.fetchval("SELECT pg_size_pretty(pg_total_relation_size('stock_movements'))")
        at = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=movements // 2)
        for label, statement, args in explained_statements("WH-001", "SKU-000042", at):
            # EXPLAIN ANALYZE first (it also warms the cache), then one timed run as the CLI would make it.
            plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {statement}", *args))
            started = time.perf_counter()
            await conn.fetch(statement, *args)
            seconds = time.perf_counter() - started
            results.append({"query": label, "seconds": seconds, "plan": plan})
            say(f"{label}: {seconds:.3f} s")
    finally:
        await conn.close()
        if opts.keep or reuse:
            say(f"kept database {name}")
        else:
            await drop_database(admin, name)
    return {"movements": movements, "table_size": size, "jit": opts.jit, "queries": results}


def render(results: dict[str, Any]) -> str:
    lines = []
    if copy := results.get("copy"):
        lines += [(f"COPY {copy['rows']:,} movements into a table of {copy['preloaded']:,} ({copy['skus']:,} "
                   f"SKUs), batches of {BATCH}, paired:"),
                  f"  without the index: {copy['rate_without']:,.0f}/s",
                  f"  with `{copy['index']}`: {copy['rate_with']:,.0f}/s  (cost {copy['cost_percent']:+.1f} %)"]
    if levels := results.get("levels"):
        lines.append(f"level upsert, {levels['pairs']:,} pairs, {levels['batches']} batches of {levels['batch']}:")
        lines += [f"  {label}: {ms:.2f} ms/batch ({levels['cost_percent_of_upsert'][label]:+.1f} %), HOT updates "
                  f"{100 * levels['hot_update_share'][label]:.0f} %" for label, ms in levels["ms_per_batch"].items()]
    if explain := results.get("explain"):
        lines.append(f"queries on {explain['movements']:,} movements ({explain['table_size']}), warm:")
        lines += [f"  {q['query']}: {q['seconds'] * 1000:,.1f} ms" for q in explain["queries"]]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="+", choices=("copy", "levels", "explain"))
    parser.add_argument("--copy-rows", type=int, default=500_000)
    parser.add_argument("--preloaded", type=int, default=2_000_000)
    parser.add_argument("--skus", type=int, default=10_000)
    parser.add_argument("--warehouses", type=int, default=4)
    parser.add_argument("--level-batches", type=int, default=100)
    parser.add_argument("--movements", type=int, default=20_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the explain database")
    parser.add_argument("--database", help="explain on this database (kept by an earlier --keep run)")
    parser.add_argument("--jit", action="store_true", help="explain with the server's JIT (the CLI turns it off)")
    return parser.parse_args(argv)


async def main(opts: argparse.Namespace) -> int:
    admin = admin_url()
    results: dict[str, Any] = {"started": datetime.now(UTC).isoformat()}
    for what in opts.what:
        results[what] = await {"copy": bench_copy, "levels": bench_levels, "explain": bench_explain}[what](admin, opts)
    print(render(results))
    out = ROOT / "bench-results" / f"signals-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    say(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args(None))))
