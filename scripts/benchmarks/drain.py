"""drain: the worker against its physical limits and the naive loop, on the same N movements (medians of --repeat):
raw consume and raw COPY (the limits), `stock-ledger run` x1 and x--workers from spawn to drained (peak RSS, CPU),
the naive loop on a slice, one worker on N/10, and produce -> commit per row under a steady load; --batch-sizes
drains N once per size. --formats: only the drain rate of the same N as plain JSON, Avro and Protobuf (confluent-kafka's
serializers, the local Apicurio Registry: scripts/schema-registry.sh), the registry's fetches counted from the workers'
logs (one per schema id and process, never per record). How and why: docs/performance.md, "Method" and "Drain".
"""

import argparse
import asyncio
import json
import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from aiokafka import AIOKafkaConsumer
from scripts import benchkit as kit
from scripts.benchkit import BATCH, Bench, say
from tests.support import registry
from tests.support.services import produce

from stock_ledger.domain import Movement, parse
from stock_ledger.ledger import pgtime
from stock_ledger.ledger.batch import MOVEMENT_COLUMNS, Record, build_batch

NAIVE_COUNT: Final = 20_000
# What --formats declares: the tests' own mappings of the contract.
MAPPINGS: Final = {"json": None, "avro": registry.CONTRACT_AVRO_MAPPING, "protobuf": registry.PROTOBUF_MAPPING}


async def limits(bench: Bench, topic: str) -> dict[str, float]:
    """Raw consume, then raw COPY of the rows it read: what no consumer into this table can beat."""
    say("raw consume: aiokafka + msgspec over the whole topic, no database")
    started = time.perf_counter()
    kept = await bench.read_topic(topic)
    bad = sum(not isinstance(parse(r.key, r.value), Movement) for r in kept)
    consumed, expected = time.perf_counter() - started, sum((await bench.end_offsets(topic)).values())
    if len(kept) != expected or bad:
        raise RuntimeError(f"raw consume read {len(kept)} records ({bad} invalid), expected {expected}")
    say(f"raw consume: {len(kept) / consumed:,.0f}/s; raw COPY of the same rows in batches of {BATCH:,}")
    copied = 0.0
    async with bench.owner() as conn:
        await pgtime.install(conn)  # the rows' timestamps are in the wire form the worker's session takes
        await conn.execute("CREATE TABLE bench_copy (LIKE stock_movements INCLUDING ALL)")
        for start in range(0, len(kept), BATCH):
            by_partition: dict[int, list[Record]] = {}
            for r in kept[start:start + BATCH]:
                by_partition.setdefault(r.partition, []).append(r)
            rows = build_batch(topic, by_partition, dict.fromkeys(by_partition, 1)).movements
            began = time.perf_counter()
            await conn.copy_records_to_table("bench_copy", records=rows, columns=MOVEMENT_COLUMNS)
            copied += time.perf_counter() - began
        await conn.execute("DROP TABLE bench_copy")
    say(f"raw COPY: {len(kept):,} in {copied:.1f}s ({len(kept) / copied:,.0f}/s)")
    return {"raw_consume_seconds": consumed, "raw_consume_rate": len(kept) / consumed, "raw_copy_seconds": copied,
            "raw_copy_rate": len(kept) / copied}


async def naive(bench: Bench, topic: str, count: int) -> dict[str, float]:
    """The classic loop: auto-commit consumer, one INSERT per record, each its own transaction."""
    say(f"naive: auto-commit consumer, one INSERT per record, {count:,} records")
    insert = (f"INSERT INTO naive_movements ({', '.join(MOVEMENT_COLUMNS)}) "
              f"VALUES ({', '.join(f'${i + 1}' for i in range(len(MOVEMENT_COLUMNS)))})")
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
                if isinstance(m := parse(r.key, r.value), Movement):
                    await conn.execute(insert, m.movement_id, m.warehouse_id, m.sku, m.qty, m.kind, m.occurred_at,
                                       r.topic, r.partition, r.offset, datetime.fromtimestamp(r.timestamp / 1000, UTC))
                if (done := done + 1) >= count:
                    break
            seconds = time.perf_counter() - started
        finally:
            await consumer.stop()
        await conn.execute("DROP TABLE naive_movements")
    say(f"naive: {done:,} in {seconds:.1f}s ({done / seconds:,.0f}/s)")
    return {"naive_seconds": seconds, "naive_rate": done / seconds}


async def latency(bench: Bench, rate: int, seconds: float) -> dict[str, float]:
    count, topic = int(rate * seconds), await bench.create_topic(f"latency-{len(bench.topics)}")
    say(f"latency: one caught-up worker, {count:,} movements produced at {rate:,}/s")

    async def load(fleet: kit.Fleet) -> None:
        await fleet.wait_claimed(60)
        await asyncio.sleep(1)  # the first fetches after the seek
        await produce(bench.services.kafka, topic, count, rate=rate, seed=3, show_progress=True)

    # Debug level logs `batch.committed` once per batch, right after COMMIT returned: the commit time per row.
    fleet = await bench.worker(topic, "latency", env={"STOCK_LEDGER_LOG_LEVEL": "debug"}, load=load)
    async with bench.owner() as conn:
        rows = await conn.fetch("SELECT kafka_partition, kafka_offset, extract(epoch FROM kafka_timestamp)::float8 "
                                "FROM stock_movements")
    commits = kit.commit_times(w.log for w in fleet.workers)
    to_commit = [1000 * (c[0] - kafka_ts) for p, offset, kafka_ts in rows
                 if (c := kit.commit_of(commits, p, offset)) is not None]
    if missing := len(rows) - len(to_commit):
        say(f"latency: {missing} rows without a `batch.committed` line (a worker that does not log it) left out")
    result = {"latency_rows": float(len(rows)), "latency_max_ms": max(to_commit, default=float("nan")),
              **{f"latency_p{q}_ms": kit.percentile(to_commit, q / 100) for q in (50, 99)}}
    say(f"latency at {rate:,}/s: p50 {result['latency_p50_ms']:.0f} ms, p99 {result['latency_p99_ms']:.0f} ms")
    return result


async def measure(bench: Bench, a: argparse.Namespace) -> str:
    if a.formats:
        return await measure_formats(bench, a)
    small_count, res = max(1, a.count // 10), bench.results
    await bench.create_database()
    topic, small = await bench.create_topic("main"), await bench.create_topic("small")
    res["produce"] = await bench.produce(topic, a.count, seed=1)
    res["produce"] |= kit.prefixed("small_", await bench.produce(small, small_count, seed=2))
    res["runs"] = runs = []
    for r in range(a.repeat):
        say(f"=== repetition {r + 1}/{a.repeat}")
        run = await limits(bench, topic)
        run |= kit.prefixed("worker_", (await bench.worker(topic, f"w1-{r}")).result)
        run |= kit.prefixed(f"worker{a.workers}_", (await bench.worker(topic, f"w{a.workers}-{r}", a.workers)).result)
        run |= kit.prefixed("small_worker_", (await bench.worker(small, f"small-{r}")).result)
        run |= await naive(bench, topic, min(a.naive_count, a.count))
        runs.append(run | await latency(bench, a.latency_rate, a.latency_seconds))
    res["batch_sweep"] = [{"batch_max_records": float(size), **(await bench.worker(
        topic, f"batch-{size}", env={"STOCK_LEDGER_BATCH_MAX_RECORDS": str(size)})).result} for size in a.batch_sizes]
    summarise(a, res)
    if a.svg and res["batch_sweep"]:
        bench.charts[".svg"] = kit.bar_svg(
            "stock-ledger worker throughput per batch size (movements/s)",
            [(f"{int(s['batch_max_records']):,}", s["steady_rate"]) for s in res["batch_sweep"]],
            "STOCK_LEDGER_BATCH_MAX_RECORDS",
            [(res["limit_rate"], "min(raw consume, raw COPY)"), (res["limit_rate"] / 2, "target: 0.5 x that")])
    return render(a, res)


def summarise(a: argparse.Namespace, res: dict[str, Any]) -> None:
    med = res["median"] = kit.median_of(res["runs"])
    limit = res["limit_rate"] = min(med["raw_consume_rate"], med["raw_copy_rate"])
    rss_n, rss_small = med["worker_peak_rss_mib"], med["small_worker_peak_rss_mib"]
    ratios = res["ratios"] = {
        "worker_vs_limit": med["worker_rate"] / limit, "worker_steady_vs_limit": med["worker_steady_rate"] / limit,
        f"worker{a.workers}_vs_limit": med[f"worker{a.workers}_rate"] / limit,
        "worker_vs_naive": med["worker_rate"] / med["naive_rate"], "rss_n_vs_n10": rss_n / rss_small,
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
           kit.table(("measurement", "movements/s", "ratio"), ((n, f"{v:,.0f}", x) for n, v, x in rows)), "",
           (f"worker peak RSS: {m['worker_peak_rss_mib']:.0f} MiB at N, {m['small_worker_peak_rss_mib']:.0f} at N/10 "
            f"({r['rss_n_vs_n10'] - 1:+.1%}); x{a.workers}: at most {m[w + 'peak_rss_mib']:.0f} MiB each"),
           (f"worker CPU (user+sys) per 100k movements: {m['worker_cpu_seconds_per_100k']:.2f} s; x{a.workers}: "
            f"{m[w + 'cpu_seconds_per_100k']:.2f} s"),
           (f"latency at {a.latency_rate:,}/s for {a.latency_seconds:g} s, produce -> commit: p50 "
            f"{m['latency_p50_ms']:.0f} ms, p99 {m['latency_p99_ms']:.0f} ms, max {m['latency_max_ms']:.0f} ms"),
           "", "targets:",
           *(f"  [{'met' if t['met'] else 'MISSED'}] {name}: {t['value']:.3g} (target {t['target']})"
             for name, t in res["targets"].items())]
    if res["batch_sweep"]:
        out += ["", "batch size sweep (worker x1, first commit to drained):",
                kit.table(("batch", "movements/s", "peak RSS MiB"), ((f"{int(s['batch_max_records']):,}",
                      f"{s['steady_rate']:,.0f}", f"{s['peak_rss_mib']:.0f}") for s in res["batch_sweep"]))]
    return "\n".join(out)


def serialized(url: str, topic: str, form: str, count: int) -> list[tuple[bytes | None, bytes | None, list[Any]]]:
    """The same `count` movements (seeded) as confluent-kafka's `form` serializer writes them to `topic` (json: the
    contract's plain JSON, no registry)."""
    rng, start, writer = random.Random(1), datetime(2026, 11, 29, tzinfo=UTC), registry.Writer(url, topic)
    serialize = None if form == "json" else writer.avro(registry.CONTRACT_AVRO) if form == "avro" else writer.protobuf()
    records: list[tuple[bytes | None, bytes | None, list[Any]]] = []
    for i in range(count):
        d: dict[str, Any] = {"movement_id": str(uuid.UUID(int=rng.getrandbits(128))), "warehouse_id": f"WH-{i % 8}",
             "sku": f"SKU-{i % 5000:06d}", "qty": 3 if i % 2 == 0 else -1}
        kind, at = ("receipt", "pick")[i % 2], start + timedelta(seconds=i)
        if serialize is None:
            records.append((d["sku"].encode(), json.dumps(d | {"kind": kind, "occurred_at": at.isoformat()}).encode(),
                            []))
            continue
        if form == "avro":
            datum = d | {"kind": kind, "occurred_at": at}
        else:
            datum = serialize._msg_class(**d, kind=1 + i % 2)  # noqa: SLF001 - the serializer's own class
            datum.occurred_at.FromDatetime(at)
        records.append((d["sku"].encode(), serialize(datum, writer.context()), []))
    writer.close()
    return records


async def measure_formats(bench: Bench, a: argparse.Namespace) -> str:
    url, res = registry.registry_url(), bench.results
    await bench.create_database()
    for form, mapping in MAPPINGS.items():
        topic = await bench.create_topic(form)
        # One producer and one log level for all three, so only the format differs.
        await registry.send_with_headers(bench.services.kafka, topic, serialized(url, topic, form, a.count))
        say(f"{form}: {a.count:,} records sent" + ("" if mapping is None else ", serialized by confluent-kafka"))
        env = {"STOCK_LEDGER_LOG_LEVEL": "debug"} | ({} if mapping is None else {
            "STOCK_LEDGER_MAPPING": json.dumps(mapping), "SCHEMA_REGISTRY_URL": url})
        res[form] = (await bench.worker(topic, f"fmt-{form}", env=env)).result
        res[form]["registry_fetches"] = sum(p.read_text().count('"schema.fetched"')
                                            for p in bench.logs.glob(f"fmt-{form}-*.log"))
    base = res["json"]["rate"]
    rows = [(f, f"{res[f]['rate']:,.0f}", f"{res[f]['steady_rate']:,.0f}", f"{res[f]['rate'] / base:.2f}",
             f"{res[f]['cpu_seconds_per_100k']:.2f}", str(int(res[f]["registry_fetches"]))) for f in MAPPINGS]
    return "\n".join([f"stock-ledger drain --formats: N={a.count:,}, one worker per format", "", kit.table(
        ("format", "movements/s", "steady/s", "x JSON", "CPU s/100k", "registry fetches"), rows)])
