"""Benchmark the ledger against its physical limits and against the naive consumer, in one run on the same rows.

One run = one fresh topic (24 partitions) and one fresh database. N movements are produced once, then measured:

1. raw consume  aiokafka reads and decodes (msgspec, `domain.parse`) the whole topic, no database;
2. raw COPY     the same rows, built by `sink.build_batch`, COPY'd in batches of the worker's size into
                `bench_copy (LIKE stock_movements INCLUDING ALL)`: same constraints and indexes, no Kafka;
                only the COPY calls are timed, each COPY is its own transaction (one WAL flush, like a batch);
3. worker       the real `python -m stock_ledger run` draining the backlog, one process and then three: time from
                spawn to every stored offset at the log end (polled in consumer_offsets); peak RSS sampled every
                100 ms (psutil), CPU = user + sys of the worker processes;
4. naive        the classic loop (aiokafka auto-commit, one autocommitted INSERT per record) on a slice;
5. small        one worker draining N/10 from a second topic: its peak RSS must match the one at N;
6. latency      one caught-up worker while movements arrive at a steady rate: produce -> commit per row.

`--repeat R` repeats 2-6 (and 1) R times on the same topic and reports medians. Progress goes to stderr, the table
to stdout, everything to JSON (`--out`). Services: KAFKA_BOOTSTRAP_SERVERS / DATABASE_URL if set, else the
project's scripts (127.0.0.1:9092 and `scripts/postgres.sh url`), like the tests.

On 2 cores the default run (N = 1,000,000, once) takes about 2 minutes; `--repeat 3 --batch-sizes
2000,5000,10000,20000` about 5.5 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import logging
import shutil
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition

from stock_ledger import pgtime
from stock_ledger.batch import MOVEMENT_COLUMNS, Record, build_batch
from stock_ledger.domain import Movement, parse
from stock_ledger.produce import produce

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling harness, run as a script or imported
import bench_scale
from bench_scale import E2E, buckets, commit_times, percentile
from benchkit import (
    DEFAULT_BATCH,
    PARTITIONS,
    ROOT,
    STARTED,
    Bench,
    Fleet,
    Options,
    bar_svg,
    environment,
    median_of,
    run_on_uvloop,
    say,
)
from localservices import discover

if TYPE_CHECKING:
    from collections.abc import Sequence


# ------------------------------------------------------------------------------------------------ 1. raw consume


async def raw_consume(bench: Bench, topic: str, ends: dict[int, int]) -> tuple[dict[str, float], list[tuple[Any, ...]]]:
    """Read and decode the whole topic; return the rate and the records (for the COPY limit)."""
    say("raw consume: aiokafka + msgspec over the whole topic, no database")
    consumer = AIOKafkaConsumer(bootstrap_servers=bench.services.kafka, enable_auto_commit=False,
                                isolation_level="read_committed")
    kept: list[tuple[Any, ...]] = []
    total = sum(ends.values())
    started = time.perf_counter()
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        remaining = {p for p, end in ends.items() if end > 0}
        bad = 0
        while remaining:
            fetched = await consumer.getmany(timeout_ms=1000, max_records=bench.batch)
            for tp, records in fetched.items():
                for r in records:
                    if not isinstance(parse(r.key, r.value), Movement):
                        bad += 1
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


# ------------------------------------------------------------------------------------------------ 2. raw COPY


async def raw_copy(bench: Bench, topic: str, kept: Sequence[tuple[Any, ...]]) -> dict[str, float]:
    say(f"raw COPY: {len(kept):,} rows in batches of {bench.batch:,} into a copy of stock_movements")
    conn = await bench.owner()
    await pgtime.install(conn)  # the rows' timestamps are in the wire form the worker's session takes
    copied, timed = 0, 0.0
    try:
        await conn.execute("DROP TABLE IF EXISTS bench_copy")
        await conn.execute("CREATE TABLE bench_copy (LIKE stock_movements INCLUDING ALL)")
        for start in range(0, len(kept), bench.batch):
            by_partition: dict[int, list[Record]] = {}
            for p, offset, ts, key, value in kept[start:start + bench.batch]:
                by_partition.setdefault(p, []).append(Record(p, offset, ts, key, value))
            rows = build_batch(topic, by_partition, dict.fromkeys(by_partition, 1)).movements
            began = time.perf_counter()
            await conn.copy_records_to_table("bench_copy", records=rows, columns=MOVEMENT_COLUMNS)
            timed += time.perf_counter() - began
            copied += len(rows)
        await conn.execute("DROP TABLE bench_copy")
    finally:
        await conn.close()
    say(f"raw COPY: {copied:,} in {timed:.1f}s ({copied / timed:,.0f}/s)")
    return {"raw_copy_seconds": timed, "raw_copy_rate": copied / timed}


# ------------------------------------------------------------------------------------------------ 4. naive baseline


async def naive(bench: Bench, topic: str, count: int) -> dict[str, float]:
    """The classic loop: auto-commit consumer, one INSERT per record, each its own transaction."""
    say(f"naive: auto-commit consumer, one INSERT per record, {count:,} records")
    conn = await bench.owner()
    await conn.execute("DROP TABLE IF EXISTS naive_movements")
    await conn.execute("CREATE TABLE naive_movements (LIKE stock_movements INCLUDING ALL)")
    values = ", ".join(f"${i}" for i in range(1, len(MOVEMENT_COLUMNS) + 1))
    insert = f"INSERT INTO naive_movements ({', '.join(MOVEMENT_COLUMNS)}) VALUES ({values})"
    group = f"bench-{bench.run_id}-naive-{uuid.uuid4().hex[:6]}"
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bench.services.kafka, group_id=group,
                                enable_auto_commit=True, auto_offset_reset="earliest")
    await consumer.start()
    done, started = 0, 0.0
    try:
        async for r in consumer:
            if done == 0:
                started = time.perf_counter()
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
        await conn.close()
    say(f"naive: {done:,} in {seconds:.1f}s ({done / seconds:,.0f}/s)")
    return {"naive_seconds": seconds, "naive_rate": done / seconds}


# ------------------------------------------------------------------------------------------------ 6. latency


async def latency(bench: Bench) -> dict[str, float]:
    rate, seconds = bench.opts.latency_rate, bench.opts.latency_seconds
    count = int(rate * seconds)
    topic = await bench.create_topic(f"latency-{len(bench.topics)}")
    say(f"latency: one caught-up worker, {count:,} movements produced at {rate:,}/s")

    async def load(fleet: Fleet) -> None:
        await fleet.wait_claimed(60)
        await asyncio.sleep(1)  # the first fetches after the seek
        await produce(bench.services.kafka, topic, count, rate=rate, seed=3, show_progress=True)

    # Debug level adds one `batch.committed` line per batch: its timestamp is the commit as the worker saw it.
    fleet = await bench.run_workers(topic, "latency", 1, {"STOCK_LEDGER_LOG_LEVEL": "debug"}, while_running=load)
    result = await latency_from(bench.owner_url, fleet)
    say(f"latency at {rate:,}/s: p50 {result['latency_p50_ms']:.0f} ms, p99 {result['latency_p99_ms']:.0f} ms "
        f"(to the start of the batch transaction: p50 {result['latency_txn_start_p50_ms']:.0f} ms, p99 "
        f"{result['latency_txn_start_p99_ms']:.0f} ms)")
    return result


async def latency_from(owner_url: str, fleet: Fleet) -> dict[str, float]:
    """produce -> commit per row: the batch's commit time (its `batch.committed` log line) minus the record's
    Kafka timestamp (CreateTime, stamped by the producer when it accepted the record). Also from applied_at
    (now() = the start of the batch transaction, so it leaves out the transaction itself) as a cross-check."""
    conn = await asyncpg.connect(owner_url)
    try:
        rows = await conn.fetch("""
            SELECT kafka_partition, kafka_offset, extract(epoch FROM kafka_timestamp)::float8,
                   extract(epoch FROM applied_at)::float8 FROM stock_movements""")
    finally:
        await conn.close()
    commits = commit_times(p.worker.log for p in fleet.procs)
    to_commit: list[float] = []
    to_txn_start = [1000 * (r[3] - r[2]) for r in rows]
    for partition, offset, kafka_ts, _ in rows:
        lasts, ats, _ = commits.get(partition, ([], [], []))
        i = bisect.bisect_left(lasts, offset)
        if i < len(lasts):
            to_commit.append(1000 * (ats[i] - kafka_ts))
    if len(to_commit) != len(rows):
        say(f"latency: {len(rows) - len(to_commit)} rows without a batch.committed line; using applied_at")
        to_commit = to_txn_start
    # The worker's own view: the upper bound of the histogram bucket that holds its p99.
    cumulative = buckets(fleet.metrics, E2E)
    total = cumulative[-1][1] if cumulative else 0.0
    hist99 = next(le for le, n in cumulative if n >= 0.99 * total) if total else None
    return {
        "latency_rows": float(len(rows)),
        "latency_p50_ms": percentile(to_commit, 0.5),
        "latency_p99_ms": percentile(to_commit, 0.99),
        "latency_max_ms": max(to_commit, default=float("nan")),
        "latency_txn_start_p50_ms": percentile(to_txn_start, 0.5),
        "latency_txn_start_p99_ms": percentile(to_txn_start, 0.99),
        "latency_histogram_p99_le_ms": 1000 * hist99 if hist99 is not None else float("nan"),
        "latency_peak_rss_mib": fleet.summary(max(1, len(rows)))["peak_rss_mib"],
    }


# ------------------------------------------------------------------------------------------------ one run


async def measure(bench: Bench) -> dict[str, Any]:
    o = bench.opts
    small_count = max(1, o.count // 10)
    await bench.create_database()
    topic = await bench.create_topic("main")
    small = await bench.create_topic("small")
    produced = await bench.produce(topic, o.count, seed=1)
    produced |= {f"small_{k}": v for k, v in (await bench.produce(small, small_count, seed=2)).items()}
    ends = await bench.end_offsets(topic)
    if sum(ends.values()) != o.count:
        raise RuntimeError(f"topic holds {sum(ends.values())} records, expected {o.count}")
    runs: list[dict[str, float]] = []
    for r in range(o.repeat):
        say(f"=== repetition {r + 1}/{o.repeat}")
        run: dict[str, float] = {}
        consumed, kept = await raw_consume(bench, topic, ends)
        run |= consumed
        run |= await raw_copy(bench, topic, kept)
        del kept
        run |= prefixed("worker_", await bench.worker(topic, f"w1-{r}", 1, o.count))
        run |= prefixed(f"worker{o.workers}_", await bench.worker(topic, f"w{o.workers}-{r}", o.workers, o.count))
        run |= prefixed("small_worker_", await bench.worker(small, f"small-{r}", 1, small_count))
        run |= await naive(bench, topic, min(o.naive_count, o.count))
        run |= await latency(bench)
        runs.append(run)
    sweep = await batch_sweep(bench, topic) if o.batch_sizes else []
    return {"produce": produced, "runs": runs, "batch_sweep": sweep, "services": await bench.versions()}


def prefixed(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {prefix + k: v for k, v in values.items()}


async def batch_sweep(bench: Bench, topic: str) -> list[dict[str, float]]:
    results = []
    for size in bench.opts.batch_sizes:
        r = await bench.worker(topic, f"batch-{size}", 1, bench.opts.count,
                               {"STOCK_LEDGER_BATCH_MAX_RECORDS": str(size)})
        results.append({"batch_max_records": float(size), **r})
    return results


def summarise(opts: Options, measured: dict[str, Any]) -> dict[str, Any]:
    runs: list[dict[str, float]] = measured["runs"]
    med = median_of(runs)
    limit = min(med["raw_consume_rate"], med["raw_copy_rate"])
    w = f"worker{opts.workers}_"
    rss_n, rss_small = med["worker_peak_rss_mib"], med["small_worker_peak_rss_mib"]
    ratios = {
        "worker_vs_limit": med["worker_rate"] / limit,
        "worker_steady_vs_limit": med["worker_steady_rate"] / limit,
        f"worker{opts.workers}_vs_limit": med[f"{w}rate"] / limit,
        "worker_vs_naive": med["worker_rate"] / med["naive_rate"],
        "rss_n_vs_n10": rss_n / rss_small,
    }
    # Each target: the measured value, the bound, and whether the value must reach it (else stay below it).
    targets = {
        "worker >= 0.5 x min(raw consume, raw COPY)": (ratios["worker_vs_limit"], 0.5, True),
        "worker >= 20 x naive": (ratios["worker_vs_naive"], 20, True),
        "peak RSS <= 256 MiB": (max(rss_n, rss_small), 256, False),
        "peak RSS within 15% between N and N/10": (abs(rss_n / rss_small - 1), 0.15, False),
        f"latency p99 <= 250 ms at {opts.latency_rate}/s": (med["latency_p99_ms"], 250, False),
    }
    return {
        "meta": environment(opts) | {"services": measured["services"]},
        "produce": measured["produce"],
        "runs": runs,
        "median": med,
        "spread": {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in runs[0]},
        "limit_rate": limit,
        "ratios": ratios,
        "targets": {k: {"value": v, "target": t, "met": v >= t if higher else v <= t}
                    for k, (v, t, higher) in targets.items()},
        "latency_method": (
            "per row: the commit time of its batch (the worker's `batch.committed` debug line, logged right after "
            "COMMIT returned) minus the record's Kafka CreateTime (stamped by the producer); both clocks are this "
            "machine's. latency_txn_start_* use applied_at (now() = the start of the batch transaction) instead."
        ),
        "batch_sweep": measured["batch_sweep"],
    }


# ------------------------------------------------------------------------------------------------ report


def render(summary: dict[str, Any], opts: Options) -> str:
    m, r, meta = summary["median"], summary["ratios"], summary["meta"]
    w, n = f"worker{opts.workers}_", opts.count
    rows = [
        ("raw consume (aiokafka + msgspec, no DB)", m["raw_consume_rate"], ""),
        ("raw COPY (same rows, same indexes, no Kafka)", m["raw_copy_rate"], ""),
        ("worker x1, spawn to drained", m["worker_rate"],
         f"{r['worker_vs_limit']:.2f} x limit, {r['worker_vs_naive']:.1f} x naive"),
        ("worker x1, first commit to drained", m["worker_steady_rate"], f"{r['worker_steady_vs_limit']:.2f} x limit"),
        (f"worker x{opts.workers}, spawn to drained", m[w + "rate"],
         f"{r[f'worker{opts.workers}_vs_limit']:.2f} x limit"),
        (f"naive (auto-commit, INSERT per record; {min(opts.naive_count, n):,})", m["naive_rate"], ""),
    ]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if k != "psutil")
    services = meta["services"]
    width = max(len(name) for name, _, _ in rows)
    out = [
        (f"stock-ledger bench, {meta['date']}: N={n:,}, batch {opts.batch_max_records or DEFAULT_BATCH:,}, median of "
        f"{opts.repeat}"),
        (f"machine: {meta['cpus']} CPUs ({meta['cpu_model']}), {meta['memory_gib']} GiB; Python {meta['python']}, "
        f"{versions}; PostgreSQL {services['postgresql']}, Kafka {services['kafka']}"),
        "",
        f"{'measurement':<{width}}  {'movements/s':>11}  ratio",
        *(f"{name:<{width}}  {rate:>11,.0f}  {ratio}" for name, rate, ratio in rows),
        "",
        (f"worker peak RSS: {m['worker_peak_rss_mib']:.0f} MiB at N={n:,}, {m['small_worker_peak_rss_mib']:.0f} MiB at "
        f"N/10 ({100 * (r['rss_n_vs_n10'] - 1):+.1f}%); x{opts.workers}: at most {m[w + 'peak_rss_mib']:.0f} MiB each"),
        (f"worker CPU (user+sys): {m['worker_cpu_seconds_per_100k']:.2f} s per 100k movements; x{opts.workers}: "
        f"{m[w + 'cpu_seconds_per_100k']:.2f} s"),
        (f"latency at {opts.latency_rate:,}/s for {opts.latency_seconds:g} s, produce -> commit: p50 "
        f"{m['latency_p50_ms']:.0f} ms, p99 {m['latency_p99_ms']:.0f} ms, max {m['latency_max_ms']:.0f} ms"),
        (f"  (to the start of the batch transaction: p50 {m['latency_txn_start_p50_ms']:.0f} ms, p99 "
        f"{m['latency_txn_start_p99_ms']:.0f} ms; the worker's histogram: p99 <= "
        f"{m['latency_histogram_p99_le_ms']:.0f} ms)"),
        "",
        "targets:",
        *(f"  [{'met' if t['met'] else 'MISSED'}] {name}: {t['value']:.3g} (target {t['target']})"
          for name, t in summary["targets"].items()),
    ]
    if summary["batch_sweep"]:
        out += ["", "batch size sweep (worker x1, first commit to drained):"]
        out += [f"  {int(s['batch_max_records']):>6,}: {s['steady_rate']:>9,.0f}/s, "
                f"peak RSS {s['peak_rss_mib']:.0f} MiB" for s in summary["batch_sweep"]]
    return "\n".join(out)


def svg_chart(sweep: Sequence[dict[str, float]], limit: float) -> str:
    """Throughput per batch size, with the physical limit and the target as lines."""
    return bar_svg("stock-ledger worker throughput per batch size (movements/s)",
                   [(f"{int(s['batch_max_records']):,}", s["steady_rate"]) for s in sweep],
                   "STOCK_LEDGER_BATCH_MAX_RECORDS",
                   [(limit, "min(raw consume, raw COPY)"), (limit / 2, "target: 0.5 x that")])


# ------------------------------------------------------------------------------------------------ CLI


def _sizes(raw: str) -> list[int]:
    return [int(x) for x in raw.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--count", type=int, default=1_000_000, help="movements in the topic (default 1,000,000)")
    parser.add_argument("--naive-count", type=int, default=20_000, help="records for the naive baseline")
    parser.add_argument("--repeat", type=int, default=1, help="repeat the measurements and report medians")
    parser.add_argument("--latency-seconds", type=float, default=20.0, help="duration of the steady load")
    parser.add_argument("--latency-rate", type=int, default=5_000, help="movements/s of the steady load")
    parser.add_argument("--batch-max-records", type=int, default=None,
                        help=f"STOCK_LEDGER_BATCH_MAX_RECORDS for the workers (default: the worker's, {DEFAULT_BATCH})")
    parser.add_argument("--batch-sizes", type=_sizes, default=[],
                        help="also drain N once per batch size, e.g. 500,2000,5000,10000, and chart it")
    parser.add_argument("--workers", type=int, default=3, help="the multi-worker measurement (default 3)")
    parser.add_argument("--timeout", type=float, default=900.0, help="give up on a drain after this many seconds")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default bench-results/bench-<date>.json)")
    parser.add_argument("--svg", type=Path, default=None, help="chart of the batch size sweep (default next to --out)")
    a = parser.parse_args(argv)
    if a.count < 1 or a.naive_count < 1 or a.repeat < 1 or a.workers < 1 or a.latency_rate < 1:
        parser.error("--count, --naive-count, --repeat, --workers and --latency-rate must be >= 1")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = a.out or ROOT / "bench-results" / f"bench-{stamp}.json"
    svg = a.svg or (out.with_suffix(".svg") if a.batch_sizes else None)
    return Options(a.count, a.naive_count, a.repeat, a.latency_seconds, a.latency_rate, a.batch_max_records,
                   a.batch_sizes, a.workers, a.timeout, out, svg)


async def main(opts: Options) -> int:
    # stdout is for the table: the library's own log lines (migrations) go to stderr, warnings and above only.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    bench = Bench(discover(), opts)
    say(f"services ({bench.services.origin}): kafka {bench.services.kafka}; run {bench.run_id}; "
        f"worker logs in {bench.logs}")
    try:
        measured = await measure(bench)
    except BaseException:
        bench.keep_logs = True
        raise
    finally:
        await bench.drop_database()
        await bench.delete_topics()
        if bench.keep_logs:
            say(f"worker logs kept in {bench.logs}")
        else:
            shutil.rmtree(bench.logs, ignore_errors=True)
    summary = summarise(opts, measured)
    summary["meta"]["elapsed_seconds"] = round(time.monotonic() - STARTED, 1)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(summary, indent=2) + "\n")
    if opts.svg is not None and measured["batch_sweep"]:
        opts.svg.parent.mkdir(parents=True, exist_ok=True)
        opts.svg.write_text(svg_chart(measured["batch_sweep"], summary["limit_rate"]))
        say(f"chart written to {opts.svg}")
    print(render(summary, opts))
    say(f"results written to {opts.out} ({summary['meta']['elapsed_seconds']:.0f}s in all)")
    return 0


def run() -> int:
    # The ledger at scale (verify at N movements, the invariant checks, a soak) lives in bench_scale.py.
    if any(a.split("=", 1)[0] in {"--soak", "--verify-sizes"} for a in sys.argv[1:]):
        return bench_scale.run(sys.argv[1:])
    # `bench.py --peer connect [peer options]`: Kafka Connect side by side, in scripts/peer_bench.py (its own flags).
    if sys.argv[1:2] == ["--peer"] or any(a.startswith("--peer=") for a in sys.argv[1:2]):
        peer = sys.argv[2] if sys.argv[1] == "--peer" and len(sys.argv) > 2 else sys.argv[1].partition("=")[2]
        if peer != "connect":
            sys.exit(f"bench.py: --peer {peer!r} is not known; the one peer is 'connect' (scripts/peer_bench.py)")
        from peer_bench import run as run_peer  # noqa: PLC0415 - only this mode needs it

        return run_peer(sys.argv[3 if sys.argv[1] == "--peer" else 2:])
    return run_on_uvloop(main(parse_args()))


if __name__ == "__main__":
    sys.exit(run())
