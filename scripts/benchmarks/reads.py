"""reads: `stock show --at T` on a ledger of --movements, every read cold (issue 39, requirement 4).

The ledger is loaded as running workers leave it, one million movements per transaction with their stock_levels
deltas and stored offsets: 24 partitions in offset order, --warehouses x --skus pairs. Business time advances as at
--per-day movements a day (a load runs far faster than that, and a clock-time load would crowd a day's movements into
minutes, so that the windows a read must cover, minutes wide, would hold hours of them): the Kafka timestamps run
evenly up to the load's start, each movement occurred up to two minutes before its timestamp, except 0.1 %
back-dated by up to a day and 0.01 % future-dated by up to an hour. After every --closing-every movements a closing is
taken (positioned by those timestamps) and the BRIN summarized, as the monitor's leader does (ledger/closings.py).
The id registry's trigger is off during the load (it is not read here, and it is the slow part of a bulk load: "A
ledger larger than memory").

Then --queries random (warehouse, T), T uniform between the first and the last closing, each read three ways by
`stock_ledger.ledger.stock.levels` (what the CLI calls): the warehouse's stock as of T, one SKU's, and (the first
--baseline of them) the warehouse's by the whole history, as before closings. Before every read PostgreSQL is
restarted and the page cache dropped (cold; the local server only, root). The answers of the two ways are compared.
docs/performance.md, "Reads as of a time".
"""

import argparse
import asyncio
import random
import statistics
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import asyncpg
from scripts import benchkit as kit

from stock_ledger.ledger import closings, stock

TOPIC: Final = "warehouse.movements"
GROUP: Final = "stock-ledger"
# One transaction per chunk: the rows, their level deltas (the batch's arithmetic) and the stored offsets.
_LOAD: Final = """
WITH written AS (
    INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic,
                                 kafka_partition, kafka_offset, kafka_timestamp)
    SELECT gen_random_uuid(), 'WH-' || lpad((i % $3)::text, 3, '0'),
           'SKU-' || lpad((((i / $3) * 7919) % $4)::text, 6, '0'),
           CASE WHEN i % 10 < 6 THEN 1 + i % 100 ELSE -(1 + i % 100) END,
           (ARRAY['receipt', 'pick', 'return', 'transfer_in', 'transfer_out', 'adjustment'])[1 + i % 6],
           CASE WHEN i % 1000 = 7 THEN t - ((i * 7919) % 86400) * interval '1 second'
                WHEN i % 10000 = 13 THEN t + ((i * 104729) % 3600) * interval '1 second'
                ELSE t - ((i * 31) % 120) * interval '1 second' END,
           $5, (i % 24)::int, i / 24, t
      FROM generate_series($1::bigint, $2::bigint - 1) AS i,
           LATERAL (SELECT date_trunc('milliseconds', $6::timestamptz + i * $7::float8 * interval '1 second')) AS s(t)
    RETURNING warehouse_id, sku, qty
)
INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand, went_negative_at)
SELECT warehouse_id, sku, sum(qty), CASE WHEN sum(qty) < 0 THEN now() END FROM written GROUP BY 1, 2
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + excluded.on_hand,
       went_negative_at = CASE WHEN l.on_hand + excluded.on_hand < 0 THEN coalesce(l.went_negative_at, now()) END
"""
_OFFSETS: Final = """
INSERT INTO consumer_offsets (group_id, topic, partition, next_offset)
SELECT $1, $2, p, ($3::bigint - p + 23) / 24 FROM generate_series(0, 23) AS p
ON CONFLICT (group_id, topic, partition) DO UPDATE SET next_offset = excluded.next_offset
"""
CHUNK: Final = 1_000_000


async def measure(bench: kit.Bench, a: argparse.Namespace) -> str:
    if bench.services.origin != "scripts":
        raise SystemExit("reads restarts PostgreSQL before each read: it needs the local services (scripts/)")
    await bench.create_database()
    load = await _load(bench, a)
    bench.results["load"] = load
    rng = random.Random(a.seed)
    async with bench.owner() as conn:
        placed = [r[0] for r in await conn.fetch("SELECT positioned_at FROM ledger_closings ORDER BY 1")]
    first, last = placed[0], placed[-1]
    asks = [(f"WH-{rng.randrange(a.warehouses):03d}", first + (last - first) * rng.random(),
             f"SKU-{rng.randrange(a.skus):06d}") for _ in range(a.queries)]
    reads: list[dict[str, Any]] = []
    for n, (warehouse, at, sku) in enumerate(asks):
        entry: dict[str, Any] = {"warehouse": warehouse, "at": at.isoformat(), "sku": sku}
        entry["warehouse_seconds"], levels = await _cold_read(bench, (warehouse, at, None),
                                                              statements=entry.setdefault("statements", []))
        entry["sku_seconds"], one = await _cold_read(bench, (warehouse, at, sku))
        entry["skus"] = len(levels)
        if {x.sku: x.on_hand for x in one} != {sku: {x.sku: x.on_hand for x in levels}.get(sku, 0)}:
            raise RuntimeError(f"{warehouse} {sku} at {at}: the SKU's read disagrees with the warehouse's")
        if n < a.baseline:
            entry["history_seconds"], whole = await _cold_read(bench, (warehouse, at, None), whole_history=True)
            if [(x.sku, x.on_hand) for x in whole] != [(x.sku, x.on_hand) for x in levels]:
                raise RuntimeError(f"{warehouse} at {at}: the closing's answer differs from the whole history's")
        kit.say(f"read {n + 1}/{len(asks)}: {warehouse} at {at.isoformat()}: {entry['warehouse_seconds']:.3f}s, "
                f"one SKU {entry['sku_seconds']:.3f}s" + (f", whole history {entry['history_seconds']:.1f}s"
                                                         if "history_seconds" in entry else ""))
        reads.append(entry)
    if a.rebuild_brin:
        # A diagnosis, not what a ledger runs: the BRINs as one build leaves them, against as the inserts left them.
        async with bench.owner() as conn:
            began = time.perf_counter()
            await conn.execute("REINDEX INDEX stock_movements_occurred_brin")
            bench.results["rebuild_seconds"] = time.perf_counter() - began
        kit.say(f"BRINs rebuilt in {bench.results['rebuild_seconds']:.0f}s; the warehouses again")
        for n, entry in enumerate(reads):
            at = datetime.fromisoformat(entry["at"])
            entry["rebuilt_seconds"], again = await _cold_read(bench, (entry["warehouse"], at, None))
            if len(again) != entry["skus"]:
                raise RuntimeError(f"{entry['warehouse']} at {at}: a different answer after the rebuild")
            kit.say(f"read {n + 1}/{len(reads)} (rebuilt): {entry['rebuilt_seconds']:.3f}s")
    bench.results["reads"] = reads
    summary = {name: {"median": statistics.median(v), "p95": kit.percentile(v, 0.95), "max": max(v)}
               for name in ("warehouse_seconds", "sku_seconds", "history_seconds", "rebuilt_seconds")
               if (v := [r[name] for r in reads if name in r])}
    bench.results["summary"] = summary
    rows = [(name.removesuffix("_seconds"), len([r for r in reads if name in r]), f"{s['median']:.3f}",
             f"{s['p95']:.3f}", f"{s['max']:.3f}") for name, s in summary.items()]
    title = (f"stock-ledger reads: `stock show --at T` on {a.movements:,} movements ({a.per_day:,} a day), a "
             f"closing every {a.closing_every:,}, cold (PostgreSQL restarted, page cache dropped before each read)")
    sizes = (f"(load {load['seconds']:.0f}s; {load['closings']} closings of {load['pairs']:,} pairs; stock_movements "
             f"{load['movements_bytes'] / 2**30:.1f} GiB, closings {load['closings_bytes'] / 2**20:.0f} MiB, BRIN "
             f"{load['brin_bytes'] / 2**20:.1f} MiB)")
    return "\n".join([title, "", kit.table(("read", "n", "median s", "p95 s", "max s"), rows), sizes])


async def _load(bench: kit.Bench, a: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    async with bench.owner() as conn:
        await conn.execute(kit.SEGMENTS, list(range(24)), [a.movements // 24 + 1] * 24)
        await conn.execute("ALTER TABLE stock_movements DISABLE TRIGGER register_movement_ids")
        step = 86_400 / a.per_day
        start = await conn.fetchval("SELECT now() - $1::float8 * interval '1 second'", a.movements * step)
        for lo in range(0, a.movements, CHUNK):
            hi = min(a.movements, lo + CHUNK)
            async with conn.transaction():
                await conn.execute(_LOAD, lo, hi, a.warehouses, a.skus, TOPIC, start, step)
                await conn.execute(_OFFSETS, GROUP, TOPIC, hi)
            if hi % a.closing_every == 0 or hi == a.movements:
                taken = await closings.take(conn, TOPIC, every_seconds=0, daily_after_days=36_500)
                if taken.closing_id is None:
                    raise RuntimeError(f"no closing taken: {taken.skipped}")
                summarized = await closings.summarize(conn)
                kit.say(f"  {hi:,} movements ({time.perf_counter() - started:.0f}s): closing {taken.closing_id} of "
                        f"{taken.pairs:,} pairs in {taken.seconds:.1f}s, {summarized.ranges} ranges summarized")
        await conn.execute("ALTER TABLE stock_movements ENABLE TRIGGER register_movement_ids")
        # What a ledger's autovacuum would have done by now (statistics, the visibility map for index-only reads).
        await conn.execute("VACUUM (ANALYZE)")
        await _settle(conn)
        sizes = await conn.fetchrow("""
            SELECT (SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('stock_movements'))::float8 AS m,
                   pg_total_relation_size('stock_closings')::float8 AS c,
                   (SELECT sum(pg_relation_size(relid)) FROM pg_partition_tree('stock_movements_occurred_brin'))::float8
                       AS b,
                   (SELECT count(*) FROM ledger_closings) AS n, (SELECT count(*) FROM stock_levels) AS pairs""")
    return {"seconds": time.perf_counter() - started, "movements_bytes": sizes["m"], "closings_bytes": sizes["c"],
            "brin_bytes": sizes["b"], "closings": sizes["n"], "pairs": sizes["pairs"]}


# Segments whose BRIN has ranges the monitor's pass has not summarized itself (it skips a segment autovacuum holds).
_UNSETTLED: Final = "SELECT count(*) FROM brin_backlog WHERE blocks_behind > 0"


async def _settle(conn: asyncpg.Connection) -> None:
    """The monitor's summarizing pass until it has caught up with every segment, as its hourly runs would have by
    the time anyone reads (the VACUUM above may have cancelled autovacuum's own summarizing mid-range)."""
    for _ in range(120):
        summarized = await closings.summarize(conn)
        left = int(await conn.fetchval(_UNSETTLED))
        kit.say(f"  summarizing pass: {summarized.ranges} ranges, {summarized.behind} left in {left} indexes")
        if left == 0:
            return
        await asyncio.sleep(5)
    raise RuntimeError("the summarizing pass did not catch up within 10 minutes")


async def _cold_read(bench: kit.Bench, ask: tuple[str, datetime, str | None], *, whole_history: bool = False,
                     statements: list[tuple[str, float]] | None = None) -> tuple[float, list[stock.Level]]:
    """One read of (warehouse, T, SKU or None) on a freshly started server with the page cache dropped; the
    connection made before the clock. `statements` gets each statement's start and its seconds (where the time
    went)."""
    warehouse, at, sku = ask
    _cold()
    async with bench.owner() as conn:
        if statements is not None:
            conn.add_query_logger(lambda q: statements.append((" ".join(q.query.split())[:100], q.elapsed)))
        began = time.perf_counter()
        if whole_history:
            async with conn.transaction(readonly=True, isolation="repeatable_read"):
                rows = await conn.fetch(stock.FORWARD_AT, warehouse, at)
            found = [stock.Level(r["warehouse_id"], r["sku"], r["on_hand"], None) for r in rows]
        else:
            found = (await stock.levels(conn, warehouse, sku=sku, at=at)).levels
        return time.perf_counter() - began, found


def _cold() -> None:
    subprocess.run(["bash", str(kit.ROOT / "scripts" / "postgres.sh"), "restart"], check=True, capture_output=True)
    Path("/proc/sys/vm/drop_caches").write_text("3")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--movements", type=int, default=100_000_000, help="the ledger's size (default %(default)s)")
    p.add_argument("--closing-every", type=int, default=4_000_000,
                   help="movements between closings, a multiple of 1,000,000 (default %(default)s: hourly closings "
                        "at 100M movements a day)")
    p.add_argument("--per-day", type=int, default=100_000_000,
                   help="movements a day, which sets how fast business time advances (default %(default)s)")
    p.add_argument("--rebuild-brin", action="store_true",
                   help="then rebuild the BRINs and read each warehouse again (a diagnosis)")
    p.add_argument("--warehouses", type=int, default=20, help="warehouses (default %(default)s)")
    p.add_argument("--skus", type=int, default=5_000, help="SKUs per warehouse (default %(default)s)")
    p.add_argument("--queries", type=int, default=20, help="random (warehouse, T) read (default %(default)s)")
    p.add_argument("--baseline", type=int, default=3,
                   help="of them, also read by the whole history (minutes each at 100M; default %(default)s)")
    p.add_argument("--seed", type=int, default=39, help="the queries' random seed (default %(default)s)")

