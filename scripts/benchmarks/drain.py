"""drain: the worker against its physical limits and against the naive consumer, in one run on the same rows.

N movements are produced once to a fresh topic (24 partitions) and a fresh database, then measured:

1. raw consume  aiokafka reads and decodes (msgspec, `domain.parse`) the whole topic, no database;
2. raw COPY     the same rows, built by `batch.build_batch`, COPY'd in batches of the worker's size into
                `bench_copy (LIKE stock_movements INCLUDING ALL)`: same constraints and indexes, no Kafka;
                only the COPY calls are timed, each COPY is its own transaction (one WAL flush, like a batch);
3. worker       the real `python -m stock_ledger run` draining the backlog, one process and then --workers: from
                spawn to every stored offset at the log end; peak RSS sampled every 100 ms, CPU = user + sys;
4. naive        the classic loop (aiokafka auto-commit, one autocommitted INSERT per record) on a slice;
5. small        one worker draining N/10 from a second topic: its peak RSS must match the one at N;
6. latency      one caught-up worker while movements arrive at a steady rate: produce -> commit per row.

--repeat R repeats 1-6 on the same topic and reports medians; --batch-sizes drains N once per size (--svg: chart).
On 2 cores the default run (N = 1,000,000, once) takes about 2 minutes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from aiokafka import AIOKafkaConsumer, TopicPartition
from benchkit import (
    BATCH,
    E2E,
    PARTITIONS,
    Bench,
    Fleet,
    bar_svg,
    buckets,
    commit_of,
    commit_times,
    ints,
    median_of,
    percentile,
    prefixed,
    say,
    table,
)

from stock_ledger import pgtime
from stock_ledger.batch import MOVEMENT_COLUMNS, Record, build_batch
from stock_ledger.domain import Movement, parse
from stock_ledger.produce import produce

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence

NAIVE_COUNT: Final = 20_000


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    p = add("drain", __doc__, measure)
    p.add_argument("--count", type=int, default=1_000_000, help="movements in the topic (default 1,000,000)")
    p.add_argument("--repeat", type=int, default=1, help="repeat the measurements and report medians")
    p.add_argument("--batch-sizes", type=ints, default=[], help="also drain N once per batch size, e.g. 2000,5000")
    p.add_argument("--workers", type=int, default=3, help="the multi-worker measurement (default 3)")
    p.add_argument("--latency-seconds", type=float, default=20.0, help="duration of the steady load (default 20)")
    p.add_argument("--latency-rate", type=int, default=5_000, help="movements/s of the steady load (default 5,000)")
    p.add_argument("--naive-count", type=int, default=NAIVE_COUNT, help="records for the naive baseline")
    p.add_argument("--svg", action="store_true", help="chart the batch size sweep beside --out")


async def limits(bench: Bench, topic: str) -> dict[str, float]:
    """Raw consume, then raw COPY of the rows it read: what no consumer into this table can beat."""
    consumed, kept = await raw_consume(bench, topic, await bench.end_offsets(topic))
    return consumed | await raw_copy(bench, topic, kept)


async def raw_consume(bench: Bench, topic: str, ends: dict[int, int]) -> tuple[dict[str, float], list[tuple[Any, ...]]]:
    """Read and decode the whole topic; return the rate and the records (for the COPY limit)."""
    say("raw consume: aiokafka + msgspec over the whole topic, no database")
    consumer = AIOKafkaConsumer(bootstrap_servers=bench.services.kafka, enable_auto_commit=False,
                                isolation_level="read_committed")
    kept: list[tuple[Any, ...]] = []
    total, bad = sum(ends.values()), 0
    started = time.perf_counter()
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        remaining = {p for p, end in ends.items() if end > 0}
        while remaining:
            fetched = await consumer.getmany(timeout_ms=1000, max_records=BATCH)
            for tp, records in fetched.items():
                for r in records:
                    bad += not isinstance(parse(r.key, r.value), Movement)
                    kept.append((r.partition, r.offset, r.timestamp, r.key, r.value))
                if records and records[-1].offset + 1 >= ends[tp.partition]:
                    remaining.discard(tp.partition)
        seconds = time.perf_counter() - started
    finally:
        await consumer.stop()
    if len(kept) != total or bad:
        raise RuntimeError(f"raw consume read {len(kept)} records ({bad} invalid), expected {total} valid ones")
    say(f"raw consume: {total:,} in {seconds:.1f}s ({total / seconds:,.0f}/s)")
    return {"raw_consume_seconds": seconds, "raw_consume_rate": total / seconds}, kept


async def raw_copy(bench: Bench, topic: str, kept: Sequence[tuple[Any, ...]]) -> dict[str, float]:
    say(f"raw COPY: {len(kept):,} rows in batches of {BATCH:,} into a copy of stock_movements")
    copied, timed = 0, 0.0
    async with bench.owner() as conn:
        await pgtime.install(conn)  # the rows' timestamps are in the wire form the worker's session takes
        await conn.execute("CREATE TABLE bench_copy (LIKE stock_movements INCLUDING ALL)")
        for start in range(0, len(kept), BATCH):
            by_partition: dict[int, list[Record]] = {}
            for p, offset, ts, key, value in kept[start:start + BATCH]:
                by_partition.setdefault(p, []).append(Record(p, offset, ts, key, value))
            rows = build_batch(topic, by_partition, dict.fromkeys(by_partition, 1)).movements
            began = time.perf_counter()
            await conn.copy_records_to_table("bench_copy", records=rows, columns=MOVEMENT_COLUMNS)
            timed += time.perf_counter() - began
            copied += len(rows)
        await conn.execute("DROP TABLE bench_copy")
    say(f"raw COPY: {copied:,} in {timed:.1f}s ({copied / timed:,.0f}/s)")
    return {"raw_copy_seconds": timed, "raw_copy_rate": copied / timed}


async def naive(bench: Bench, topic: str, count: int) -> dict[str, float]:
    """The classic loop: auto-commit consumer, one INSERT per record, each its own transaction."""
    say(f"naive: auto-commit consumer, one INSERT per record, {count:,} records")
    values = ", ".join(f"${i}" for i in range(1, len(MOVEMENT_COLUMNS) + 1))
    insert = f"INSERT INTO naive_movements ({', '.join(MOVEMENT_COLUMNS)}) VALUES ({values})"
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bench.services.kafka, enable_auto_commit=True,
                                group_id=f"bench-{bench.run_id}-naive-{uuid.uuid4().hex[:6]}",
                                auto_offset_reset="earliest")
    done, started = 0, 0.0
    async with bench.owner() as conn:
        await conn.execute("CREATE TABLE naive_movements (LIKE stock_movements INCLUDING ALL)")
        await consumer.start()
        try:
            async for r in consumer:
                started = started or time.perf_counter()
                m = parse(r.key, r.value)
                if isinstance(m, Movement):
                    await conn.execute(insert, m.movement_id, m.warehouse_id, m.sku, m.qty, m.kind, m.occurred_at,
                                       r.topic, r.partition, r.offset, datetime.fromtimestamp(r.timestamp / 1000, UTC))
                done += 1
                if done >= count:
                    break
            seconds = time.perf_counter() - started
        finally:
            await consumer.stop()
        await conn.execute("DROP TABLE naive_movements")
    say(f"naive: {done:,} in {seconds:.1f}s ({done / seconds:,.0f}/s)")
    return {"naive_seconds": seconds, "naive_rate": done / seconds}


async def latency(bench: Bench, rate: int, seconds: float) -> dict[str, float]:
    count = int(rate * seconds)
    topic = await bench.create_topic(f"latency-{len(bench.topics)}")
    say(f"latency: one caught-up worker, {count:,} movements produced at {rate:,}/s")

    async def load(fleet: Fleet) -> None:
        await fleet.wait_claimed(60)
        await asyncio.sleep(1)  # the first fetches after the seek
        await produce(bench.services.kafka, topic, count, rate=rate, seed=3, show_progress=True)

    # Debug level adds one `batch.committed` line per batch: its timestamp is the commit as the worker saw it.
    fleet = await bench.run_workers(topic, "latency", 1, {"STOCK_LEDGER_LOG_LEVEL": "debug"}, while_running=load)
    # produce -> commit per row: that commit time minus the record's Kafka CreateTime (stamped by the producer);
    # from applied_at (now() = the start of the batch transaction, so without the transaction) as a cross-check.
    async with bench.owner() as conn:
        rows = await conn.fetch("""
            SELECT kafka_partition, kafka_offset, extract(epoch FROM kafka_timestamp)::float8,
                   extract(epoch FROM applied_at)::float8 FROM stock_movements""")
    commits = commit_times(p.worker.log for p in fleet.procs)
    to_commit: list[float] = []
    to_txn_start = [1000 * (r[3] - r[2]) for r in rows]
    for partition, offset, kafka_ts, _ in rows:
        if (commit := commit_of(commits, partition, offset)) is not None:
            to_commit.append(1000 * (commit[0] - kafka_ts))
    if len(to_commit) != len(rows):
        say(f"latency: {len(rows) - len(to_commit)} rows without a batch.committed line; using applied_at")
        to_commit = to_txn_start
    # The worker's own view: the upper bound of the histogram bucket that holds its p99.
    cumulative = buckets(fleet.metrics, E2E)
    total = cumulative[-1][1] if cumulative else 0.0
    hist99 = next(le for le, n in cumulative if n >= 0.99 * total) if total else None
    result = {
        "latency_rows": float(len(rows)),
        "latency_p50_ms": percentile(to_commit, 0.5),
        "latency_p99_ms": percentile(to_commit, 0.99),
        "latency_max_ms": max(to_commit, default=float("nan")),
        "latency_txn_start_p50_ms": percentile(to_txn_start, 0.5),
        "latency_txn_start_p99_ms": percentile(to_txn_start, 0.99),
        "latency_histogram_p99_le_ms": 1000 * hist99 if hist99 is not None else float("nan"),
        "latency_peak_rss_mib": fleet.summary(max(1, len(rows)))["peak_rss_mib"],
    }
    say(f"latency at {rate:,}/s: p50 {result['latency_p50_ms']:.0f} ms, p99 {result['latency_p99_ms']:.0f} ms "
        f"(to the start of the batch transaction: p50 {result['latency_txn_start_p50_ms']:.0f} ms, p99 "
        f"{result['latency_txn_start_p99_ms']:.0f} ms)")
    return result


async def measure(bench: Bench, a: argparse.Namespace) -> str:
    small_count = max(1, a.count // 10)
    await bench.create_database()
    topic, small = await bench.create_topic("main"), await bench.create_topic("small")
    res = bench.results
    res["produce"] = await bench.produce(topic, a.count, seed=1)
    res["produce"] |= prefixed("small_", await bench.produce(small, small_count, seed=2))
    res["runs"] = runs = []
    for r in range(a.repeat):
        say(f"=== repetition {r + 1}/{a.repeat}")
        run = await limits(bench, topic)
        run |= prefixed("worker_", await bench.worker(topic, f"w1-{r}", 1, a.count))
        run |= prefixed(f"worker{a.workers}_", await bench.worker(topic, f"w{a.workers}-{r}", a.workers, a.count))
        run |= prefixed("small_worker_", await bench.worker(small, f"small-{r}", 1, small_count))
        run |= await naive(bench, topic, min(a.naive_count, a.count))
        run |= await latency(bench, a.latency_rate, a.latency_seconds)
        runs.append(run)
    res["batch_sweep"] = [{"batch_max_records": float(size), **await bench.worker(
        topic, f"batch-{size}", 1, a.count, STOCK_LEDGER_BATCH_MAX_RECORDS=str(size))} for size in a.batch_sizes]
    summarise(a, res)
    if a.svg and res["batch_sweep"]:
        bench.charts[".svg"] = bar_svg(
            "stock-ledger worker throughput per batch size (movements/s)",
            [(f"{int(s['batch_max_records']):,}", s["steady_rate"]) for s in res["batch_sweep"]],
            "STOCK_LEDGER_BATCH_MAX_RECORDS",
            [(res["limit_rate"], "min(raw consume, raw COPY)"), (res["limit_rate"] / 2, "target: 0.5 x that")])
    return render(a, res)


def summarise(a: argparse.Namespace, res: dict[str, Any]) -> None:
    runs: list[dict[str, float]] = res["runs"]
    med = res["median"] = median_of(runs)
    res["spread"] = {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in runs[0]}
    limit = res["limit_rate"] = min(med["raw_consume_rate"], med["raw_copy_rate"])
    rss_n, rss_small = med["worker_peak_rss_mib"], med["small_worker_peak_rss_mib"]
    ratios = res["ratios"] = {
        "worker_vs_limit": med["worker_rate"] / limit,
        "worker_steady_vs_limit": med["worker_steady_rate"] / limit,
        f"worker{a.workers}_vs_limit": med[f"worker{a.workers}_rate"] / limit,
        "worker_vs_naive": med["worker_rate"] / med["naive_rate"],
        "rss_n_vs_n10": rss_n / rss_small,
    }
    # Each target: the measured value, the bound, and whether the value must reach it (else stay below it).
    targets = {
        "worker >= 0.5 x min(raw consume, raw COPY)": (ratios["worker_vs_limit"], 0.5, True),
        "worker >= 20 x naive": (ratios["worker_vs_naive"], 20, True),
        "peak RSS <= 256 MiB": (max(rss_n, rss_small), 256, False),
        "peak RSS within 15% between N and N/10": (abs(rss_n / rss_small - 1), 0.15, False),
        f"latency p99 <= 250 ms at {a.latency_rate}/s": (med["latency_p99_ms"], 250, False),
    }
    res["targets"] = {k: {"value": v, "target": t, "met": v >= t if higher else v <= t}
                      for k, (v, t, higher) in targets.items()}
    res["latency_method"] = (
        "per row: the commit time of its batch (the worker's `batch.committed` debug line, logged right after "
        "COMMIT returned) minus the record's Kafka CreateTime (stamped by the producer); both clocks are this "
        "machine's. latency_txn_start_* use applied_at (now() = the start of the batch transaction) instead.")


def render(a: argparse.Namespace, res: dict[str, Any]) -> str:
    m, r, w = res["median"], res["ratios"], f"worker{a.workers}_"
    rows = [
        ("raw consume (aiokafka + msgspec, no DB)", m["raw_consume_rate"], ""),
        ("raw COPY (same rows, same indexes, no Kafka)", m["raw_copy_rate"], ""),
        ("worker x1, spawn to drained", m["worker_rate"],
         f"{r['worker_vs_limit']:.2f} x limit, {r['worker_vs_naive']:.1f} x naive"),
        ("worker x1, first commit to drained", m["worker_steady_rate"], f"{r['worker_steady_vs_limit']:.2f} x limit"),
        (f"worker x{a.workers}, spawn to drained", m[w + "rate"], f"{r[w + 'vs_limit']:.2f} x limit"),
        (f"naive (auto-commit, INSERT per record; {min(a.naive_count, a.count):,})", m["naive_rate"], ""),
    ]
    out = [f"stock-ledger drain: N={a.count:,}, batch {BATCH:,}, median of {a.repeat}", "",
           table(("measurement", "movements/s", "ratio"), ((n, f"{v:,.0f}", x) for n, v, x in rows)), "",
           (f"worker peak RSS: {m['worker_peak_rss_mib']:.0f} MiB at N={a.count:,}, "
            f"{m['small_worker_peak_rss_mib']:.0f} MiB at N/10 ({100 * (r['rss_n_vs_n10'] - 1):+.1f}%); "
            f"x{a.workers}: at most {m[w + 'peak_rss_mib']:.0f} MiB each"),
           (f"worker CPU (user+sys): {m['worker_cpu_seconds_per_100k']:.2f} s per 100k movements; x{a.workers}: "
            f"{m[w + 'cpu_seconds_per_100k']:.2f} s"),
           (f"latency at {a.latency_rate:,}/s for {a.latency_seconds:g} s, produce -> commit: p50 "
            f"{m['latency_p50_ms']:.0f} ms, p99 {m['latency_p99_ms']:.0f} ms, max {m['latency_max_ms']:.0f} ms"),
           (f"  (to the start of the batch transaction: p50 {m['latency_txn_start_p50_ms']:.0f} ms, p99 "
            f"{m['latency_txn_start_p99_ms']:.0f} ms; the worker's histogram: p99 <= "
            f"{m['latency_histogram_p99_le_ms']:.0f} ms)"), "", "targets:",
           *(f"  [{'met' if t['met'] else 'MISSED'}] {name}: {t['value']:.3g} (target {t['target']})"
             for name, t in res["targets"].items())]
    if res["batch_sweep"]:
        out += ["", "batch size sweep (worker x1, first commit to drained):",
                table(("batch", "movements/s", "peak RSS MiB"), ((f"{int(s['batch_max_records']):,}",
                      f"{s['steady_rate']:,.0f}", f"{s['peak_rss_mib']:.0f}") for s in res["batch_sweep"]))]
    return "\n".join(out)
