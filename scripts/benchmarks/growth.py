"""growth and scale-out: `stock-ledger run` draining one fresh backlog of --backlog movements, medians of --repeat.

growth: on a ledger preloaded to each of --sizes movements (the backlog deleted again after each drain): the rate,
the invariant scans, WAL and buffer reads per movement, the sizes. scale-out: by --workers processes, on an empty
ledger. How and why: docs/performance.md, "Ledger growth" and "Scale-out".
"""

import argparse
import contextlib
import subprocess
import time
from pathlib import Path
from typing import Any, Final

from scripts import benchkit as kit

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
# The backlog's rows gone again, and their qty taken out of stock_levels.
_FORGET: Final = """
WITH gone AS (DELETE FROM stock_movements WHERE kafka_topic = $1 RETURNING warehouse_id, sku, qty),
     sums AS (SELECT warehouse_id, sku, sum(qty) AS total FROM gone GROUP BY 1, 2)
UPDATE stock_levels AS l SET on_hand = l.on_hand - s.total,
       went_negative_at = CASE WHEN l.on_hand - s.total < 0 THEN coalesce(l.went_negative_at, now()) END
  FROM sums AS s WHERE l.warehouse_id = s.warehouse_id AND l.sku = s.sku
"""
# Sizes, WAL written so far and this database's shared-buffer reads and hits (the WAL counter is server-wide).
_SIZES: Final = """
SELECT (SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('stock_movements'))::float8
           AS movements_total_bytes,
       (SELECT sum(pg_relation_size(relid)) FROM pg_partition_tree('stock_movements'))::float8 AS movements_heap_bytes,
       pg_relation_size('stock_movements_movement_id_key')::float8 AS movement_id_index_bytes,
       (SELECT sum(pg_relation_size(relid)) FROM pg_partition_tree('stock_movements_coordinates_key'))::float8
           AS coordinates_index_bytes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8 AS wal_bytes, blks_read::float8 AS blocks_read,
       blks_hit::float8 AS blocks_hit, (SELECT wal_fpi FROM pg_stat_wal)::float8 AS wal_fpi
  FROM pg_stat_database WHERE datname = current_database()
"""
IO: Final = ("wal_bytes", "wal_fpi", "blocks_read", "blocks_hit")
CGROUP: Final = Path("/sys/fs/cgroup/memory/stock-ledger-bench")
# The invariants' full-table scans.
SCANS: Final = {"duplicates": "SELECT count(*) - count(DISTINCT (kafka_topic, kafka_partition, kafka_offset)) "
                              "FROM stock_movements", "level_mismatches": kit.MISMATCH_COUNT}


def per_million(size_bytes: float, rows: int) -> float:
    """MiB per million movements (NaN for an empty ledger: fixed overhead only)."""
    return size_bytes / 1024**2 / (rows / 1e6) if rows else float("nan")


def scaling_efficiency(rates: dict[int, float]) -> dict[int, float]:
    """rate(n) / (n x rate(1)): 1.0 is linear scaling."""
    base = rates.get(1)
    return {n: r / (n * base) for n, r in rates.items()} if base else {}


async def measure_scaleout(bench: kit.Bench, a: argparse.Namespace) -> str:
    await bench.create_database()
    results, topic = bench.results.setdefault("scaleout", []), await bench.create_topic("backlog")
    bench.results["produce"] = await bench.produce(topic, a.backlog, seed=11)
    for n in a.workers:
        runs = [(await bench.worker(topic, f"scale-x{n}-{r}", n)).result for r in range(a.repeat)]
        results.append({"workers": float(n), **kit.median_of(runs)})
    eff = scaling_efficiency({int(s["workers"]): s["rate"] for s in results})
    bench.charts["-scaleout.svg"] = kit.bar_svg(
        f"drain rate of {a.backlog:,} movements by worker count (movements/s)",
        [(f"x{int(s['workers'])}", s["rate"]) for s in results], "worker processes")
    return "\n".join([f"stock-ledger scale-out: backlog {a.backlog:,}, median of {a.repeat}", "", kit.table(
        ("workers", "movements/s (spawn)", "(first commit)", "efficiency", "CPU s/100k", "peak RSS MiB"),
        ((int(s["workers"]), f"{s['rate']:,.0f}", f"{s['steady_rate']:,.0f}",
          f"{eff[int(s['workers'])]:.2f}" if eff else "-", f"{s['cpu_seconds_per_100k']:.2f}",
          f"{s['peak_rss_mib']:.0f}") for s in results))])


async def measure_growth(bench: kit.Bench, a: argparse.Namespace) -> str:
    await bench.create_database()
    results, topic, have = bench.results.setdefault("growth", []), await bench.create_topic("backlog"), 0
    bench.results["produce"] = await bench.produce(topic, a.backlog, seed=11)
    for size in sorted(a.sizes):
        kit.say(f"growth: ledger of {size:,} movements")
        async with bench.owner() as conn:
            if size > have:
                await conn.execute(kit.SEGMENTS, list(range(24)), [size // 24] * 24)
                await kit.bulk_load(conn, "stock_movements", _PRELOAD, [
                    (lo, min(size, lo + 1_000_000)) for lo in range(have, size, 1_000_000)], maintenance_work_mem="1GB")
                await conn.execute(kit.LEVELS_FROM_MOVEMENTS)
                await conn.execute("VACUUM (ANALYZE) stock_movements")
            shared_buffers, have, runs = await conn.fetchval("SHOW shared_buffers"), size, []
        for r in range(a.repeat):
            if a.postgres_memory:
                confine_postgres(a.postgres_memory)
            try:
                before = await stats(bench)
                run = (await bench.worker(topic, f"growth-{size}-{r}", fresh=False)).result
                after = await stats(bench)
            finally:  # the bulk loads and the next steps unconfined; and the server as found afterwards
                for pid in (CGROUP / "cgroup.procs").read_text().split() if a.postgres_memory else ():
                    with contextlib.suppress(ProcessLookupError):  # a backend that has ended since
                        (CGROUP.parent / "cgroup.procs").write_text(pid)
            runs.append(run | {k: v for k, v in after.items() if k not in IO} | {
                f"{k}_per_movement": (after[k] - before[k]) / a.backlog for k in IO} | await scans(bench, a.skip_scans))
            async with bench.owner() as conn:  # the backlog forgotten again: rows, stock, offsets
                for statement in (_FORGET, "DELETE FROM consumer_offsets WHERE topic = $1"):
                    await conn.execute(statement, topic)
                await conn.execute("VACUUM (ANALYZE) stock_movements")
                await conn.execute("VACUUM stock_levels")
        entry: dict[str, Any] = {"ledger_movements": size, **kit.median_of(runs), "shared_buffers": shared_buffers,
                                 "postgres_memory": a.postgres_memory or "unlimited"}
        entry["mib_per_million"] = per_million(entry["movements_total_bytes"], size + a.backlog)
        kit.say(f"growth {size:,}: {entry['rate']:,.0f}/s, {entry['mib_per_million']:,.0f} MiB per million")
        results.append(entry)
    base, nan = results[0]["rate"], float("nan")
    bench.charts["-growth.svg"] = kit.bar_svg(
        f"drain rate of {a.backlog:,} fresh movements by ledger size (movements/s)",
        [(f"{g['ledger_movements'] / 1e6:g}M", g["rate"]) for g in results], "movements already in the ledger",
        [(0.7 * base, "target: 0.7 x empty")])
    return "\n".join([f"stock-ledger growth: backlog {a.backlog:,}, median of {a.repeat}", "", kit.table(
        ("ledger movements", "drain/s", "vs first", "scans s (dup + levels)", "stock_movements MiB", "MiB/M",
         "movement_id idx MiB", "coords idx MiB", "WAL B/mvmt", "FPI/mvmt", "reads/mvmt"),
        ((f"{g['ledger_movements']:,}", f"{g['rate']:,.0f}", f"{g['rate'] / base:.2f}",
          f"{g.get('scan_duplicates_seconds', nan):.2f} + {g.get('scan_level_mismatches_seconds', nan):.2f}",
          f"{g['movements_total_bytes'] / 2**20:,.0f}", f"{g['mib_per_million']:,.0f}",
          f"{g['movement_id_index_bytes'] / 2**20:,.0f}", f"{g['coordinates_index_bytes'] / 2**20:,.0f}",
          f"{g['wal_bytes_per_movement']:,.0f}", f"{g['wal_fpi_per_movement']:.2f}",
          f"{g['blocks_read_per_movement']:.2f}") for g in results)),
        f"(shared_buffers {results[0]['shared_buffers']}, PostgreSQL memory {results[0]['postgres_memory']})"])


def confine_postgres(limit: str) -> None:
    """Every postgres process in a memory cgroup of `limit` (its later children inherit it), the page cache dropped
    so that it is charged anew: indexes that no longer fit, as at billions of rows on a large server."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "memory.limit_in_bytes").write_text(limit)
    pids = subprocess.run(["pgrep", "-x", "postgres"], capture_output=True, text=True, check=False).stdout.split()
    if not pids:
        raise RuntimeError("--postgres-memory: no postgres process found (it confines the local server only)")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            (CGROUP / "cgroup.procs").write_text(pid)
    Path("/proc/sys/vm/drop_caches").write_text("3")
    kit.say(f"  {len(pids)} postgres processes confined to {limit}, page cache dropped")


async def stats(bench: kit.Bench) -> dict[str, float]:
    async with bench.owner() as conn:
        return dict(await conn.fetchrow(_SIZES) or {})


async def scans(bench: kit.Bench, skip: bool) -> dict[str, float]:
    result: dict[str, float] = {}
    async with bench.owner() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        for name, sql in () if skip else SCANS.items():
            began = time.perf_counter()
            value = await conn.fetchval(sql)
            result[f"scan_{name}_seconds"] = time.perf_counter() - began
            if value:
                raise RuntimeError(f"invariant scan {name} found {value}: the preload or the forget step is wrong")
    return result
