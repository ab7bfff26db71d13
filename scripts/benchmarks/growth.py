"""growth and scale-out: the real `stock-ledger run` draining one fresh backlog of --backlog movements (24 partitions).

growth     the ledger preloaded to each of --sizes movements (server-side `INSERT … SELECT generate_series` in
           chunks of 1M: random v4 UUIDs like real ids, the producer's warehouses/SKUs, another topic name,
           stock_levels made to match), then at each size: the backlog drained by one worker on top of it, the two
           invariant scans timed, WAL and buffer reads per movement, and the database size per million. After each
           drain the backlog's rows are deleted again (and subtracted from stock_levels, then VACUUM) so the next
           size drains the same movements on a ledger of exactly that size.
scale-out  the backlog drained by each of --workers worker processes, each time on an empty ledger; time from the
           first spawn to every stored offset at the log end.

Every drain is repeated --repeat times and reported as the median; a bar chart goes beside --out.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

from benchkit import LEVEL_MISMATCHES, LEVELS_FROM_MOVEMENTS, Bench, bar_svg, bulk_load, ints, median_of, say, table

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

CHUNK: Final = 1_000_000
# The invariant scans (a change in invariants.py should be measured here too).
SCANS: Final = {
    "duplicates": "SELECT count(*) - count(DISTINCT (kafka_topic, kafka_partition, kafka_offset)) FROM stock_movements",
    "level_mismatches": LEVEL_MISMATCHES,
}
# Rows like produce.movements(): 4 warehouses, 1,000 SKUs, the same kinds; offsets continue per partition.
_PRELOAD: Final = """
INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                             kafka_offset, kafka_timestamp, applied_at)
SELECT gen_random_uuid(), 'WH-' || lpad((i % 4)::text, 3, '0'), 'SKU-' || lpad(((i * 7919) % 1000)::text, 6, '0'),
       CASE WHEN i % 10 < 6 THEN 1 + i % 100 ELSE -(1 + i % 100) END,
       (ARRAY['receipt', 'pick', 'return', 'transfer_in', 'transfer_out', 'adjustment'])[1 + i % 6],
       timestamptz '2025-01-01' + i * interval '10 ms', 'warehouse.movements.history', (i % 24)::int, i / 24,
       timestamptz '2025-01-01' + i * interval '10 ms', now()
  FROM generate_series($1::bigint, $2::bigint - 1) AS i
"""
_FORGET: Final = """
WITH gone AS (DELETE FROM stock_movements WHERE kafka_topic = $1 RETURNING warehouse_id, sku, qty),
     sums AS (SELECT warehouse_id, sku, sum(qty) AS total FROM gone GROUP BY 1, 2)
UPDATE stock_levels AS l SET on_hand = l.on_hand - s.total,
       went_negative_at = CASE WHEN l.on_hand - s.total < 0 THEN coalesce(l.went_negative_at, now()) END
  FROM sums AS s
 WHERE l.warehouse_id = s.warehouse_id AND l.sku = s.sku
"""
# Sizes, WAL written so far and this database's shared-buffer reads and hits (the WAL counter is server-wide).
_SIZES: Final = """
SELECT pg_database_size(current_database())::float8 AS database_bytes,
       pg_total_relation_size('stock_movements')::float8 AS movements_total_bytes,
       pg_relation_size('stock_movements')::float8 AS movements_heap_bytes,
       pg_relation_size('stock_movements_movement_id_key')::float8 AS movement_id_index_bytes,
       pg_relation_size('stock_movements_coordinates_key')::float8 AS coordinates_index_bytes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 AS wal_bytes, blks_read::float8 AS blocks_read,
       blks_hit::float8 AS blocks_hit
  FROM pg_stat_database WHERE datname = current_database()
"""
IO: Final = ("wal_bytes", "blocks_read", "blocks_hit")


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    for name, measure, summary in (("growth", measure_growth, "drain rate and invariant scans as the ledger grows"),
                                   ("scale-out", measure_scaleout, "drain rate by worker count")):
        p = add(name, __doc__, measure, summary)
        p.add_argument("--backlog", type=int, default=500_000, help="movements in the fresh backlog (default 500,000)")
        p.add_argument("--repeat", type=int, default=1, help="repeat each drain and report medians")
        if name == "growth":
            p.add_argument("--sizes", type=ints, default=[0, 1_000_000, 5_000_000, 20_000_000],
                           help="ledger sizes to preload, ascending (default 0,1000000,5000000,20000000)")
            p.add_argument("--skip-scans", action="store_true", help="do not time the invariant scans (minutes at 20M)")
        else:
            p.add_argument("--workers", type=ints, default=[1, 2, 3, 6], help="worker counts (default 1,2,3,6)")


def per_million(size_bytes: float, rows: int) -> float:
    """MiB per million movements (NaN for an empty ledger: fixed overhead only)."""
    return size_bytes / 1024**2 / (rows / 1e6) if rows else float("nan")


def scaling_efficiency(rates: dict[int, float]) -> dict[int, float]:
    """rate(n) / (n x rate(1)): 1.0 is linear scaling."""
    base = rates.get(1)
    return {n: r / (n * base) for n, r in rates.items()} if base else {}


async def backlog(bench: Bench, a: argparse.Namespace) -> str:
    await bench.create_database()
    topic = await bench.create_topic("backlog")
    bench.results["produce"] = await bench.produce(topic, a.backlog, seed=11)
    return topic


async def measure_scaleout(bench: Bench, a: argparse.Namespace) -> str:
    topic = await backlog(bench, a)
    results = bench.results["scaleout"] = []
    for n in a.workers:
        runs = [await bench.worker(topic, f"scale-x{n}-{r}", n, a.backlog) for r in range(a.repeat)]
        results.append({"workers": float(n), **median_of(runs)})
    eff = scaling_efficiency({int(s["workers"]): s["rate"] for s in results})
    bench.charts["-scaleout.svg"] = bar_svg(
        f"drain rate of {a.backlog:,} movements by worker count (movements/s)",
        [(f"x{int(s['workers'])}", s["rate"]) for s in results], "worker processes")
    return "\n".join([f"stock-ledger scale-out: backlog {a.backlog:,}, median of {a.repeat}", "", table(
        ("workers", "movements/s (spawn)", "(first commit)", "efficiency", "CPU s/100k", "peak RSS MiB"),
        ((int(s["workers"]), f"{s['rate']:,.0f}", f"{s['steady_rate']:,.0f}", f"{eff[int(s['workers'])]:.2f}"
          if eff else "-", f"{s['cpu_seconds_per_100k']:.2f}", f"{s['peak_rss_mib']:.0f}") for s in results))])


async def measure_growth(bench: Bench, a: argparse.Namespace) -> str:
    topic = await backlog(bench, a)
    results: list[dict[str, Any]] = bench.results.setdefault("growth", [])  # in place: a failure keeps the sizes done
    have = 0
    for size in sorted(a.sizes):
        say(f"growth: ledger of {size:,} movements")
        started = time.perf_counter()
        async with bench.owner() as conn:
            if size > have:
                await bulk_load(conn, "stock_movements", _PRELOAD,
                                [(lo, min(size, lo + CHUNK)) for lo in range(have, size, CHUNK)],
                                maintenance_work_mem="1GB")
                await conn.execute(LEVELS_FROM_MOVEMENTS)
                await conn.execute("VACUUM (ANALYZE) stock_movements")
            shared_buffers = await conn.fetchval("SHOW shared_buffers")
        have, preload_seconds = size, time.perf_counter() - started
        runs = []
        for r in range(a.repeat):
            before = await ledger_stats(bench)
            run = await bench.worker(topic, f"growth-{size}-{r}", 1, a.backlog, fresh=False)
            after = await ledger_stats(bench)
            run |= {f"{k}_per_movement": (after[k] - before[k]) / a.backlog for k in IO}
            run |= {k: v for k, v in after.items() if k not in IO} | ({} if a.skip_scans else await scans(bench))
            runs.append(run)
            await forget(bench, topic)
        entry: dict[str, Any] = {"ledger_movements": size, "preload_seconds": preload_seconds, **median_of(runs),
                                 "shared_buffers": shared_buffers}
        entry["mib_per_million"] = per_million(entry["movements_total_bytes"], size + a.backlog)
        say(f"growth {size:,}: {entry['rate']:,.0f}/s, stock_movements {entry['movements_total_bytes'] / 2**20:,.0f} "
            f"MiB ({entry['mib_per_million']:,.0f} MiB per million)")
        results.append(entry)
    base = results[0]["rate"]
    bench.charts["-growth.svg"] = bar_svg(
        f"drain rate of {a.backlog:,} fresh movements by ledger size (movements/s)",
        [(f"{g['ledger_movements'] / 1e6:g}M", g["rate"]) for g in results], "movements already in the ledger",
        [(0.7 * base, "target: 0.7 x empty")])
    nan = float("nan")
    return "\n".join([f"stock-ledger growth: backlog {a.backlog:,}, median of {a.repeat}", "", table(
        ("ledger movements", "drain/s", "vs first", "scans s (dup + levels)", "stock_movements MiB", "MiB/M",
         "movement_id idx MiB", "coords idx MiB"),
        ((f"{g['ledger_movements']:,}", f"{g['rate']:,.0f}", f"{g['rate'] / base:.2f}",
          f"{g.get('scan_duplicates_seconds', nan):.2f} + {g.get('scan_level_mismatches_seconds', nan):.2f}",
          f"{g['movements_total_bytes'] / 2**20:,.0f}", f"{g['mib_per_million']:,.0f}",
          f"{g['movement_id_index_bytes'] / 2**20:,.0f}", f"{g['coordinates_index_bytes'] / 2**20:,.0f}")
         for g in results)), f"(shared_buffers {results[0]['shared_buffers']})"])


async def ledger_stats(bench: Bench) -> dict[str, float]:
    async with bench.owner() as conn:
        return dict(await conn.fetchrow(_SIZES) or {})


async def scans(bench: Bench) -> dict[str, float]:
    result: dict[str, float] = {}
    async with bench.owner() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        for name, sql in SCANS.items():
            began = time.perf_counter()
            value = await conn.fetchval(sql)
            result[f"scan_{name}_seconds"] = time.perf_counter() - began
            if value:
                raise RuntimeError(f"invariant scan {name} found {value} after a clean drain: the preload or the "
                                   "forget step broke the ledger")
    return result


async def forget(bench: Bench, topic: str) -> None:
    """Remove a drained backlog from the ledger again (rows, their stock, their offsets), then VACUUM."""
    async with bench.owner() as conn:
        await conn.execute(_FORGET, topic)
        await conn.execute("DELETE FROM consumer_offsets WHERE topic = $1", topic)
        await conn.execute("VACUUM (ANALYZE) stock_movements")
        await conn.execute("VACUUM stock_levels")
