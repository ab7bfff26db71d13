"""Cost as the ledger grows, and the scale-out curve: the real `stock-ledger run` draining one fresh backlog.

One run = one fresh database and one backlog topic (24 partitions) of `--backlog` movements, produced once.

1. scale-out  the backlog drained by 1, 2, 3 and 6 worker processes (`--workers`), each time on an empty ledger;
              time from the first spawn to every stored offset at the log end (benchkit.Fleet, as in scripts/bench.py).
2. growth     the ledger preloaded to each of `--sizes` movements (server-side `INSERT … SELECT generate_series`
              in chunks of 1M: random v4 UUIDs like real ids, the producer's warehouses/SKUs, another topic name,
              stock_levels made to match), then at each size: the backlog drained by one worker on top of it,
              the two invariant scans of positions.py timed (and EXPLAIN'd), and the database size per million.
              After each drain the backlog's rows are deleted again (and subtracted from stock_levels, then
              VACUUM) so the next size drains the same movements on a ledger of exactly that size.

Every drain is repeated `--repeat` times and reported as the median. Progress goes to stderr, the tables to stdout,
everything to JSON (`--out`, default bench-results/ledger-<date>.json) and two SVG charts beside it. Not in CI (it
runs for minutes): `.venv/bin/python scripts/ledger_bench.py --sizes 0,1000000,5000000 --backlog 500000`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog
from benchkit import ROOT, Bench, Options, bar_svg, environment, keep_partial, median_of, run_on_uvloop, say
from localservices import discover

if TYPE_CHECKING:
    from collections.abc import Sequence

CHUNK: Final = 1_000_000
HISTORY_TOPIC: Final = "warehouse.movements.history"
# The invariant scans of positions.py, verbatim (a change there should be measured here too).
SCANS: Final = {
    "duplicates": "SELECT count(*) - count(DISTINCT (kafka_topic, kafka_partition, kafka_offset)) FROM stock_movements",
    "level_mismatches": """
        SELECT count(*) FROM (SELECT warehouse_id, sku, sum(qty) AS total FROM stock_movements GROUP BY 1, 2) AS m
        FULL JOIN stock_levels AS l USING (warehouse_id, sku)
        WHERE coalesce(m.total, 0) <> coalesce(l.on_hand, 0)""",
}
# Rows like produce.movements(): 4 warehouses, 1,000 SKUs, the same kinds; offsets continue per partition.
_PRELOAD: Final = f"""
INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                             kafka_offset, kafka_timestamp, applied_at)
SELECT gen_random_uuid(), 'WH-' || lpad((i % 4)::text, 3, '0'), 'SKU-' || lpad(((i * 7919) % 1000)::text, 6, '0'),
       CASE WHEN i % 10 < 6 THEN 1 + i % 100 ELSE -(1 + i % 100) END,
       (ARRAY['receipt', 'pick', 'return', 'transfer_in', 'transfer_out', 'adjustment'])[1 + i % 6],
       timestamptz '2025-01-01' + i * interval '10 ms', '{HISTORY_TOPIC}', (i % 24)::int, i / 24,
       timestamptz '2025-01-01' + i * interval '10 ms', now()
  FROM generate_series($1::bigint, $2::bigint - 1) AS i
"""
_DROP_KEYS: Final = """
ALTER TABLE stock_movements DROP CONSTRAINT stock_movements_coordinates_key,
                            DROP CONSTRAINT stock_movements_movement_id_key
"""
_ADD_KEYS: Final = """
ALTER TABLE stock_movements
  ADD CONSTRAINT stock_movements_coordinates_key UNIQUE (kafka_topic, kafka_partition, kafka_offset),
  ADD CONSTRAINT stock_movements_movement_id_key UNIQUE (movement_id)
"""
# went_negative_at is kept in step with on_hand (migration 0004's CHECK), as the batch transaction keeps it.
_LEVELS: Final = """
INSERT INTO stock_levels (warehouse_id, sku, on_hand, went_negative_at)
SELECT warehouse_id, sku, sum(qty), CASE WHEN sum(qty) < 0 THEN now() END FROM stock_movements GROUP BY 1, 2
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = excluded.on_hand, went_negative_at = excluded.went_negative_at
"""
_FORGET: Final = """
WITH gone AS (DELETE FROM stock_movements WHERE kafka_topic = $1 RETURNING warehouse_id, sku, qty),
     sums AS (SELECT warehouse_id, sku, sum(qty) AS total FROM gone GROUP BY 1, 2)
UPDATE stock_levels AS l SET on_hand = l.on_hand - s.total,
       went_negative_at = CASE WHEN l.on_hand - s.total < 0 THEN coalesce(l.went_negative_at, now()) END
  FROM sums AS s
 WHERE l.warehouse_id = s.warehouse_id AND l.sku = s.sku
"""
_SIZES: Final = """
SELECT pg_database_size(current_database()), pg_total_relation_size('stock_movements'),
       pg_relation_size('stock_movements'), pg_relation_size('stock_movements_movement_id_key'),
       pg_relation_size('stock_movements_coordinates_key'), current_setting('shared_buffers')
"""


@dataclass(frozen=True)
class LedgerOptions:
    backlog: int
    sizes: list[int]
    workers: list[int]
    repeat: int
    timeout: float
    skip_scaleout: bool
    skip_scans: bool
    out: Path


def per_million(size_bytes: float, rows: int) -> float:
    """MiB per million movements (NaN for an empty ledger: fixed overhead only)."""
    return size_bytes / 1024**2 / (rows / 1e6) if rows else float("nan")


def scan_seconds(entry: dict[str, Any], name: str) -> float:
    """How long invariant scan `name` took (NaN when --skip-scans)."""
    return float(entry.get(f"scan_{name}_seconds", float("nan")))


def scaling_efficiency(rates: dict[int, float]) -> dict[int, float]:
    """rate(n) / (n x rate(1)): 1.0 is linear scaling."""
    base = rates.get(1)
    return {n: r / (n * base) for n, r in rates.items()} if base else {}


# ------------------------------------------------------------------------------------------------ measurements


async def drain(bench: Bench, topic: str, label: str, workers: int, count: int) -> dict[str, float]:
    """`workers` processes drain `topic` (within --timeout) on top of whatever the ledger holds (no TRUNCATE,
    unlike bench.py's drains)."""
    fleet = await bench.run_workers(topic, label, workers, group=f"ledger-{bench.run_id}-{label}", fresh=False)
    result = fleet.summary(count)
    say(f"  {label}: x{workers} {count:,} in {result['seconds']:.1f}s ({result['rate']:,.0f}/s from spawn, "
        f"{result['steady_rate']:,.0f}/s from first commit), peak RSS {result['peak_rss_mib']:.0f} MiB, "
        f"{result['cpu_seconds_per_100k']:.2f} CPU s per 100k")
    return result


async def forget(bench: Bench, topic: str) -> None:
    """Remove a drained backlog from the ledger again (rows, their stock, their offsets), then VACUUM."""
    conn = await bench.owner()
    try:
        await conn.execute(_FORGET, topic)
        await conn.execute("DELETE FROM consumer_offsets WHERE topic = $1", topic)
        await conn.execute("VACUUM (ANALYZE) stock_movements")
        await conn.execute("VACUUM stock_levels")
    finally:
        await conn.close()


async def preload(bench: Bench, have: int, want: int) -> float:
    """Grow the history from `have` to `want` movements; return the seconds it took."""
    conn = await bench.owner()
    started = time.perf_counter()
    try:
        # Loading without the two unique indexes and building them afterwards (a sort) is several times faster
        # than 1M random-UUID index inserts per chunk; the constraints come back exactly as 0001_ledger.sql
        # declares them. The rebuilt indexes are compact (fillfactor 90), so the next inserts split pages at once.
        await conn.execute("SET maintenance_work_mem = '1GB'")
        await conn.execute(_DROP_KEYS)
        for lo in range(have, want, CHUNK):
            hi = min(want, lo + CHUNK)
            await conn.execute(_PRELOAD, lo, hi)
            say(f"  preload: {hi:,}/{want:,} movements ({(hi - have) / (time.perf_counter() - started):,.0f}/s)")
        say("  preload: rebuilding the unique constraints")
        await conn.execute(_ADD_KEYS)
        await conn.execute(_LEVELS)
        await conn.execute("VACUUM (ANALYZE) stock_movements")
    finally:
        await conn.close()
    return time.perf_counter() - started


async def scans(bench: Bench) -> dict[str, float]:
    conn = await bench.owner()
    result: dict[str, float] = {}
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            for name, sql in SCANS.items():
                started = time.perf_counter()
                value = await conn.fetchval(sql)
                result[f"scan_{name}_seconds"] = time.perf_counter() - started
                if value:
                    raise RuntimeError(f"invariant scan {name} found {value} after a clean drain: the preload or the "
                                       "forget step broke the ledger; keep the database and look")
    finally:
        await conn.close()
    return result


async def sizes(bench: Bench) -> dict[str, Any]:
    conn = await bench.owner()
    try:
        row = await conn.fetchrow(_SIZES)
    finally:
        await conn.close()
    assert row is not None  # noqa: S101 - one row, always
    names = ("database_bytes", "movements_total_bytes", "movements_heap_bytes", "movement_id_index_bytes",
             "coordinates_index_bytes")
    return {**{n: float(row[i]) for i, n in enumerate(names)}, "shared_buffers": str(row[5])}


async def io_counters(bench: Bench) -> dict[str, float]:
    """WAL bytes written so far, and this database's shared-buffer reads (misses) and hits: what a drain costs in
    I/O, per movement, once differenced (the WAL counter is server-wide: other databases' writes are included)."""
    conn = await bench.owner()
    try:
        row = await conn.fetchrow("""
            SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8, blks_read::float8, blks_hit::float8
              FROM pg_stat_database WHERE datname = current_database()""")
    finally:
        await conn.close()
    assert row is not None  # noqa: S101 - the current database has a row
    return {"wal_bytes": row[0], "blocks_read": row[1], "blocks_hit": row[2]}


async def scaleout(bench: Bench, topic: str, o: LedgerOptions) -> list[dict[str, float]]:
    results = []
    for n in o.workers:
        runs = []
        for r in range(o.repeat):
            await bench.reset_ledger()
            runs.append(await drain(bench, topic, f"scale-x{n}-{r}", n, o.backlog))
        results.append({"workers": float(n), **median_of(runs)})
    return results


async def growth(bench: Bench, topic: str, o: LedgerOptions, deadline: float | None,
                 summary: dict[str, Any]) -> list[dict[str, Any]]:
    await bench.reset_ledger()
    results: list[dict[str, Any]] = summary["growth"]  # filled in place: a failure keeps the sizes done
    have = 0
    for size in o.sizes:
        if deadline is not None and time.time() > deadline:
            say(f"growth: stopping before {size:,} (--stop-at reached)")
            break
        say(f"growth: ledger of {size:,} movements")
        seconds = await preload(bench, have, size) if size > have else 0.0
        have = size
        runs = []
        for r in range(o.repeat):
            before = await io_counters(bench)
            runs.append(await drain(bench, topic, f"growth-{size}-{r}", 1, o.backlog))
            after = await io_counters(bench)
            runs[-1] |= {f"{k}_per_movement": (after[k] - before[k]) / o.backlog for k in before}
            timed = {} if o.skip_scans else await scans(bench)
            measured = timed | {k: v for k, v in (await sizes(bench)).items() if k != "shared_buffers"}
            runs[-1] |= measured
            await forget(bench, topic)
        entry: dict[str, Any] = {"ledger_movements": size, "preload_seconds": seconds, **median_of(runs)}
        entry["mib_per_million"] = per_million(entry["movements_total_bytes"], size + o.backlog)
        entry["shared_buffers"] = (await sizes(bench))["shared_buffers"]
        say(f"growth {size:,}: {entry['rate']:,.0f}/s, scans {scan_seconds(entry, 'duplicates'):.2f}s + "
            f"{scan_seconds(entry, 'level_mismatches'):.2f}s, stock_movements "
            f"{entry['movements_total_bytes'] / 2**20:,.0f} MiB ({entry['mib_per_million']:,.0f} MiB per million)")
        results.append(entry)
    return results


# ------------------------------------------------------------------------------------------------ report


def render(summary: dict[str, Any]) -> str:
    out = [(f"stock-ledger growth and scale-out, {summary['meta']['date']}: backlog {summary['backlog']:,}, "
           f"median of {summary['repeat']}"), ""]
    if summary["scaleout"]:
        out += ["workers  movements/s (spawn)  (first commit)  efficiency  CPU s/100k  peak RSS MiB"]
        eff = scaling_efficiency({int(s["workers"]): s["rate"] for s in summary["scaleout"]})
        out += [f"{int(s['workers']):>7}  {s['rate']:>19,.0f}  {s['steady_rate']:>14,.0f}  "
                f"{eff.get(int(s['workers']), float('nan')):>10.2f}  {s['cpu_seconds_per_100k']:>10.2f}  "
                f"{s['peak_rss_mib']:>12.0f}" for s in summary["scaleout"]]
        out.append("")
    if summary["growth"]:
        base = summary["growth"][0]["rate"]
        out += [("ledger movements  drain/s  vs first  scans s (dup + levels)  stock_movements MiB  MiB/M  "
                "movement_id idx MiB  coords idx MiB")]
        out += [f"{g['ledger_movements']:>16,}  {g['rate']:>7,.0f}  {g['rate'] / base:>8.2f}  "
                f"{scan_seconds(g, 'duplicates'):>8.2f} + {scan_seconds(g, 'level_mismatches'):>5.2f}        "
                f"{g['movements_total_bytes'] / 2**20:>19,.0f}  {g['mib_per_million']:>5,.0f}  "
                f"{g['movement_id_index_bytes'] / 2**20:>19,.0f}  {g['coordinates_index_bytes'] / 2**20:>14,.0f}"
                for g in summary["growth"]]
        out.append(f"(shared_buffers {summary['growth'][0]['shared_buffers']})")
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> tuple[LedgerOptions, float | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--backlog", type=int, default=500_000, help="movements in the fresh backlog (default 500,000)")
    p.add_argument("--sizes", default="0,1000000,5000000,20000000", help="ledger sizes to preload, ascending")
    p.add_argument("--workers", default="1,2,3,6", help="worker counts of the scale-out curve")
    p.add_argument("--repeat", type=int, default=1, help="repeat each drain and report medians")
    p.add_argument("--timeout", type=float, default=900.0, help="give up on a drain after this many seconds")
    p.add_argument("--skip-scaleout", action="store_true", help="only the growth curve")
    p.add_argument("--skip-scans", action="store_true", help="do not time the invariant scans (minutes at 20M)")
    p.add_argument("--stop-at", default=None, help="HH:MM (UTC): start no further ledger size after this time")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default bench-results/ledger-<date>.json)")
    a = p.parse_args(argv)
    sizes_ = sorted(int(x) for x in a.sizes.split(",") if x.strip())
    workers = [int(x) for x in a.workers.split(",") if x.strip()]
    if a.backlog < 1 or a.repeat < 1 or any(s < 0 for s in sizes_) or any(w < 1 for w in workers):
        p.error("--backlog and --repeat must be >= 1, --sizes >= 0, --workers >= 1")
    deadline = None
    if a.stop_at:
        hh, mm = (int(x) for x in a.stop_at.split(":"))
        deadline = datetime.now(UTC).replace(hour=hh, minute=mm, second=0, microsecond=0).timestamp()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = a.out or ROOT / "bench-results" / f"ledger-{stamp}.json"
    return LedgerOptions(a.backlog, sizes_, workers, a.repeat, a.timeout, a.skip_scaleout, a.skip_scans, out), deadline


async def main(o: LedgerOptions, deadline: float | None) -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    bench_opts = Options.drains_only(o.backlog, o.repeat, o.timeout, o.out)
    bench = Bench(discover(), bench_opts)
    say(f"run {bench.run_id}: backlog {o.backlog:,}, sizes {o.sizes}, workers {o.workers}; logs in {bench.logs}")
    summary: dict[str, Any] = {"backlog": o.backlog, "repeat": o.repeat, "scaleout": [], "growth": []}
    try:
        await bench.create_database()
        topic = await bench.create_topic("backlog")
        summary["produce"] = await bench.produce(topic, o.backlog, seed=11)
        if not o.skip_scaleout:
            say("=== scale-out")
            summary["scaleout"] = await scaleout(bench, topic, o)
        say("=== growth")
        summary["growth"] = await growth(bench, topic, o, deadline, summary)
        summary["services"] = await bench.versions()
    except BaseException:
        keep_partial(o.out, summary)  # the shared PostgreSQL was restarted under a run twice
        raise
    finally:
        await bench.drop_database()
        await bench.delete_topics()
        say(f"worker logs in {bench.logs}" if bench.keep_logs else "done")
    summary["meta"] = environment(bench_opts) | {"ledger_options": {k: str(v) for k, v in vars(o).items()}}
    o.out.parent.mkdir(parents=True, exist_ok=True)
    o.out.write_text(json.dumps(summary, indent=2) + "\n")
    if summary["scaleout"]:
        o.out.with_name(o.out.stem + "-scaleout.svg").write_text(bar_svg(
            f"drain rate of {o.backlog:,} movements by worker count (movements/s, 2 cores)",
            [(f"x{int(s['workers'])}", s["rate"]) for s in summary["scaleout"]], "worker processes"))
    if summary["growth"]:
        base = summary["growth"][0]["rate"]
        o.out.with_name(o.out.stem + "-growth.svg").write_text(bar_svg(
            f"drain rate of {o.backlog:,} fresh movements by ledger size (movements/s)",
            [(f"{g['ledger_movements'] / 1e6:g}M", g["rate"]) for g in summary["growth"]],
            "movements already in the ledger",
            [(0.7 * base, "target: 0.7 x empty")]))
    print(render(summary))
    say(f"results written to {o.out}")
    return 0


def run() -> int:
    opts, deadline = parse_args()
    return run_on_uvloop(main(opts, deadline))


if __name__ == "__main__":
    sys.exit(run())
