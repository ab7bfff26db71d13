"""soak and verify: the ledger under a steady load for minutes, and `stock-ledger verify` at millions of movements.

soak: one worker, a paced producer at --rate for --minutes; per minute the worker's histograms, RSS, the database,
the host's disk writes and CPU shares; then exact per-row latency and `stock-ledger verify`. verify: per --sizes N,
a topic and a ledger to match; verify's time and peak RSS, then the invariant checks (a full pass, three minutes of
traffic). How and why: docs/performance.md, "Soak" and "verify".
"""

import argparse
import asyncio
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import asyncpg
import psutil
from prometheus_client.parser import text_string_to_metric_families
from scripts import benchkit as kit
from scripts.benchkit import MIB, PARTITIONS, ROOT, Bench, say

from stock_ledger.audit.invariants import Invariants

KAFKA_LIBS: Final = Path(os.environ.get("KAFKA_LIBS", kit.CACHE / f"kafka-{kit.KAFKA_VERSION}" / "libs"))
E2E, TXN, CHECKS = ("stock_ledger_end_to_end_latency_seconds", "stock_ledger_batch_duration_seconds",
                    "stock_ledger_invariant_check_duration_seconds")
NAN: Final = float("nan")
Metrics = dict[str, dict[tuple[tuple[str, str], ...], float]]


def java_producer(kafka: str, topic: str, count: int, mode: str | None = None) -> list[str] | None:
    """scripts/FastProducer.java's argv (`mode`: a rate, "sparse" or None: tiny); None without Java or the jars."""
    if shutil.which("java") is None or not (KAFKA_LIBS / f"kafka-clients-{kit.KAFKA_VERSION}.jar").exists():
        return None
    # Paced, it shares the host with what it measures: C1 and the serial GC cost least (pinned-2026-12-02/).
    paced = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"] if mode not in {None, "sparse"} else []
    return ["java", "-Xmx256m", *paced, "-cp", f"{KAFKA_LIBS}/*", str(ROOT / "scripts" / "FastProducer.java"), kafka,
            topic, str(count), str(PARTITIONS), *([mode] if mode else [])]


# A partition's movements at its coordinates, applied_at rising at 5,000/s to now (the checks read recent rows).
_AT_COORDINATES: Final = """
INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                             kafka_offset, kafka_timestamp, applied_at)
SELECT gen_random_uuid(), 'WH-' || lpad((o % 4)::text, 3, '0'), 'SKU-' || lpad(((o * 7919 + $2) % 1000)::text, 6, '0'),
       CASE WHEN o % 3 = 0 THEN -(o % 100 + 1) ELSE o % 100 + 1 END, CASE WHEN o % 3 = 0 THEN 'pick' ELSE 'receipt' END,
       t, $1, $2, o, t, t
  FROM generate_series(0::bigint, $3::bigint - 1) AS o,
       LATERAL (SELECT now() - ($3 - o) * $4::int * interval '200 microseconds') AS a(t)
"""
# A batch in one transaction: 1,000 rows past each partition's stored offset, the offsets and the levels moved.
_APPEND: Final = """
WITH o AS (UPDATE consumer_offsets SET next_offset = next_offset + 1000 WHERE group_id = $1
           RETURNING partition AS p, next_offset - 1000 AS lo),
ins AS (
  INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                               kafka_offset, kafka_timestamp)
  SELECT gen_random_uuid(), 'WH-' || lpad((x % 4)::text, 3, '0'),
         'SKU-' || lpad(((x * 7919 + o.p) % 1000)::text, 6, '0'), x % 100 + 1, 'receipt', now(), $2, o.p, x, now()
    FROM o, generate_series(o.lo, o.lo + 999) AS x
  RETURNING warehouse_id, sku, qty)
INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand)
SELECT warehouse_id, sku, sum(qty) FROM ins GROUP BY 1, 2
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + excluded.on_hand,
    went_negative_at = CASE WHEN l.on_hand + excluded.on_hand < 0 THEN coalesce(l.went_negative_at, now()) END
"""
# Run from a small interpreter: a child inherits its parent's RSS high-water mark (ru_maxrss) across exec.
_MEASURE: Final = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
"""


async def preload(conn: asyncpg.Connection, topic: str, group: str, ends: dict[int, int]) -> None:
    """The ledger of the topic: its movements, stock_levels their sums, the stored offsets at the log end."""
    for statement in ("SET max_parallel_workers_per_gather = 0", "SET max_parallel_maintenance_workers = 0",
                      "SET synchronous_commit = off", "DROP INDEX stock_movements_applied_at_brin"):
        await conn.execute(statement)
    await conn.execute(kit.SEGMENTS, list(ends), list(ends.values()))
    await kit.bulk_load(conn, "stock_movements", _AT_COORDINATES, [(topic, p, n, PARTITIONS) for p, n in ends.items()])
    await conn.execute("CREATE INDEX stock_movements_applied_at_brin ON stock_movements USING brin (applied_at)")
    await conn.execute(kit.LEVELS_FROM_MOVEMENTS)
    await conn.execute("""INSERT INTO consumer_offsets (group_id, topic, partition, next_offset)
                          SELECT $1, $2, p, n FROM unnest($3::int[], $4::bigint[]) AS e(p, n)""",
                       group, topic, list(ends), list(ends.values()))
    await conn.execute("VACUUM (ANALYZE) stock_movements")


def run_measured(argv: Sequence[str], env: dict[str, str], out: Path) -> dict[str, Any]:
    """Run a command: its wall time, exit code, peak RSS (its own, see _MEASURE), CPU and last line of stdout."""
    started, usage = time.perf_counter(), out.with_suffix(".rusage")
    with out.open("wb") as stdout, out.with_suffix(".err").open("wb") as stderr:
        subprocess.run([sys.executable, "-I", "-c", _MEASURE, str(usage), *argv], env=env, stdout=stdout,
                       stderr=stderr, check=False)
    code, maxrss_kib, cpu = usage.read_text().split()
    lines = out.read_text(errors="replace").splitlines()
    return {"seconds": time.perf_counter() - started, "exit_code": int(code), "peak_rss_mib": int(maxrss_kib) / 1024,
            "last_line": lines[-1] if lines else "", "cpu_seconds": float(cpu)}


async def verify_measured(bench: Bench, topic: str, group: str) -> dict[str, Any]:
    env = bench.worker_env(topic, group) | {"DATABASE_URL": bench.services.url_for(bench.database)}  # the owner
    result = await asyncio.to_thread(run_measured, [sys.executable, "-m", "stock_ledger", "verify"], env,
                                     bench.logs / f"verify-{bench.database}.out")
    say(f"verify: {result}")
    return result


async def invariant_costs(conn: asyncpg.Connection, topic: str, group: str, rate: int) -> dict[str, Any]:
    checks, incremental = Invariants(full_scan_seconds=21_600), []
    full = await checks.check(conn, full=True)
    say(f"invariants: full pass {full.seconds:.2f}s (mismatches {full.level_mismatches})")
    for minute in range(3):
        for _ in range(max(1, rate * 60 // PARTITIONS // 1000)):
            await conn.execute(_APPEND, group, topic)
        checked = await checks.check(conn, full=False)
        incremental.append(checked.seconds)
        say(f"invariants: minute {minute + 1}: {1000 * checked.seconds:.0f} ms over {checked.rows_checked:,} rows")
        if checked.level_mismatches or checked.partitions_ahead or not checked.coordinates_unique:
            raise RuntimeError(f"invariants failed on a consistent ledger: {checked}")
    return {"full_seconds": full.seconds, "incremental_seconds": sorted(incremental),
            "incremental_median_seconds": sorted(incremental)[1]}


async def measure_verify(bench: Bench, a: argparse.Namespace) -> str:
    results = bench.results["verify_sizes"] = []
    for n in a.sizes:
        database, topic = await bench.create_database(f"n{n}"), await bench.create_topic(f"n{n}")
        group = f"bench-{bench.run_id}-n{n}"
        say(f"N={n:,}: producing {topic} ({a.records} records)")
        if argv := java_producer(bench.services.kafka, topic, n, "sparse" if a.records == "sparse" else None):
            done = await asyncio.to_thread(subprocess.run, ["nice", *argv], capture_output=True, text=True,
                                           timeout=3600, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"FastProducer exited with {done.returncode}:\n{done.stderr[-3000:]}")
        else:  # without Java or the jars: real movements, slower
            await bench.produce(topic, n, seed=5)
        if sum((ends := await bench.end_offsets(topic)).values()) != n:
            raise RuntimeError(f"the topic holds {sum(ends.values())} records, expected {n}")
        async with bench.owner() as conn:
            await preload(conn, topic, group, ends)
        verified = await verify_measured(bench, topic, group)
        if verified["exit_code"] != 0 or verified["last_line"] != f"{n}|{n}":
            raise RuntimeError(f"verify failed on a consistent ledger: {verified}; see {bench.logs}")
        async with bench.owner(server_settings={"max_parallel_workers_per_gather": "0"}) as conn:  # one core
            costs = await invariant_costs(conn, topic, group, a.rate)
        results.append({"movements": n, "records": a.records, "verify": verified, "invariants": costs})
        await bench.drop_database(database)
        await bench.delete_topic(topic)
    return kit.table(("movements", "records", "verify s", "verify peak RSS MiB", "invariants: full s",
                      "incremental ms (median of 3)"),
                     ((f"{r['movements']:,}", r["records"], f"{r['verify']['seconds']:.1f}",
                       f"{r['verify']['peak_rss_mib']:.0f}", f"{r['invariants']['full_seconds']:.2f}",
                       f"{1000 * r['invariants']['incremental_median_seconds']:.0f}") for r in results))


def scrape(port: int) -> Metrics:
    """name -> labels -> value, from the worker's /metrics."""
    found: Metrics = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for s in (s for family in text_string_to_metric_families(r.read().decode()) for s in family.samples):
            found.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    return found


def minute_of(now: Metrics, before: Metrics, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative (le, count) buckets between two scrapes, sorted by le."""
    old = before.get(f"{name}_bucket", {})
    return sorted((float(dict(k)["le"]), n - old.get(k, 0.0)) for k, n in now.get(f"{name}_bucket", {}).items())


def quantile(cumulative: Sequence[tuple[float, float]], q: float) -> float:
    """histogram_quantile: linear interpolation inside the bucket that holds quantile q."""
    if not cumulative or cumulative[-1][1] <= 0:
        return NAN
    rank, prev_le, prev_n = q * cumulative[-1][1], 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:  # the +Inf bucket has no upper edge: its lower one
            return prev_le if le == float("inf") else prev_le + (le - prev_le) * (
                (rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return prev_le


def exact_percentiles(values: Sequence[float]) -> dict[str, float]:
    if not (ordered := sorted(values)):
        return {"rows": 0}
    return {"rows": len(ordered), **{f"p{q}_ms": kit.percentile(ordered, q / 100) for q in (50, 95, 99)},
            "max_ms": ordered[-1], "under_50ms": sum(1 for v in ordered if v <= 50) / len(ordered)}


class DiskWrites:
    """The host's disk writes per 100 ms (/sys/block, whole disks): a COMMIT behind a writeback burst waits for it."""

    BURST_MIB: Final = 8.0

    def __init__(self) -> None:
        self.disks = [d / "stat" for d in sorted(Path("/sys/block").glob("*")) if (d / "device").exists()]
        self.steps: list[float] = []

    def written_mib(self) -> float:
        # /sys/block/<disk>/stat: the 7th field is sectors written, in 512-byte units whatever the device's own.
        return sum(int(f.read_text().split()[6]) for f in self.disks) * 512 / MIB

    async def run(self) -> None:
        """Sample until cancelled."""
        last = self.written_mib()
        while self.disks:
            await asyncio.sleep(0.1)
            self.steps.append((now := self.written_mib()) - last)
            last = now

    def take(self) -> dict[str, float] | None:
        """The minute since the last call, and start the next one."""
        steps, self.steps = self.steps, []
        return {"written_mib": sum(steps), "max_mib_per_100ms": max(steps),
                "bursts": sum(s >= self.BURST_MIB for s in steps)} if steps else None


class CpuShares:
    """Per minute, the host's busy and stolen CPU and each process's % of a core (None: not here): whose slow minute?"""

    def __init__(self, worker: psutil.Process, producer: psutil.Process | None = None) -> None:
        self.own = {p.pid: name for name, p in (("worker", worker), ("producer", producer)) if p is not None}
        self.host, self.spent = psutil.cpu_times(), self._by_process()

    def _by_process(self) -> dict[tuple[int, float], tuple[str, float]]:
        """CPU seconds so far of each process that counts, keyed by (pid, start time): a reused pid is new."""
        spent = {}
        for proc in psutil.process_iter(["name", "cmdline", "cpu_times", "create_time"]):
            if (info := proc.info)["cpu_times"] is None:  # gone, or not ours to read
                continue
            name = self.own.get(proc.pid) or ("postgres" if info["name"] in {"postgres", "postmaster"} else
                                              "broker" if "kafka.Kafka" in (info["cmdline"] or ()) else None)
            if name is not None:
                spent[proc.pid, info["create_time"]] = (name, info["cpu_times"].user + info["cpu_times"].system)
        return spent

    def take(self) -> dict[str, float | None]:
        host, spent = psutil.cpu_times(), self._by_process()
        # guest and guest_nice are already inside user and nice: counting them again would inflate the total.
        times = {f: getattr(host, f) - getattr(self.host, f) for f in host._fields if not f.startswith("guest")}
        total = sum(times.values()) or 1.0
        # A process started during the minute counts whole; one that ended during it is lost.
        shares: dict[str, float | None] = dict.fromkeys(("worker", "producer", "postgres", "broker"))
        for key, (name, seconds) in spent.items():
            shares[name] = (shares[name] or 0.0) + seconds - self.spent.get(key, (name, 0.0))[1]
        self.host, self.spent, core = host, spent, total / psutil.cpu_count()
        return {"host_busy_pct": 100 * (total - times.get("idle", 0.0) - times.get("iowait", 0.0)) / total,
                "steal_pct": 100 * times.get("steal", 0.0) / total,
                **{f"{name}_cpu_pct": None if s is None else 100 * s / core for name, s in shares.items()}}


def prime_wal() -> str:
    """WAL segments recycled, as after a checkpoint cycle at load: not zero-filled by the batch that needs one."""
    if os.environ.get("DATABASE_URL"):
        say("the WAL pool is not primed (PostgreSQL from DATABASE_URL): a new server stalls until its checkpoints")
        return "not primed: PostgreSQL from DATABASE_URL"
    subprocess.run(["bash", str(ROOT / "scripts" / "postgres.sh"), "prime-wal"], stdout=subprocess.DEVNULL, check=True)
    return "primed by scripts/postgres.sh prime-wal"


def cpu_text(cpu: dict[str, float | None]) -> str:
    return (f"host {cpu['host_busy_pct']:.0f}% busy ({cpu['steal_pct']:.0f}% stolen); % of a core: " + ", ".join(
        f"{label} {'-' if (v := cpu[f'{name}_cpu_pct']) is None else f'{v:.0f}'}" for name, label in (
            ("worker", "worker"), ("postgres", "PostgreSQL"), ("broker", "broker"), ("producer", "producer"))))


async def minute_row(minute: int, fleet: kit.Fleet, scrapes: tuple[Metrics, Metrics], disk: dict[str, float] | None,
                     cpu: dict[str, float | None]) -> dict[str, Any]:
    (before, now), checks = scrapes, {}
    e2e, txn = minute_of(now, before, E2E), minute_of(now, before, TXN)
    async with fleet.bench.owner() as conn:
        db_bytes = int(await conn.fetchval("SELECT pg_database_size(current_database())"))
    for scope in ("baseline", "incremental", "full"):
        n, s = (now.get(CHECKS + x, {}).get((("scope", scope),), 0.0)
                - before.get(CHECKS + x, {}).get((("scope", scope),), 0.0) for x in ("_count", "_sum"))
        if n:
            checks[scope] = {"count": n, "seconds": s}
    records = e2e[-1][1] if e2e else 0
    row = {"minute": minute, "records": records, **{f"p{q}_ms": 1000 * quantile(e2e, q / 100) for q in (50, 95, 99)},
           "under_50ms": next((n / records for le, n in e2e if le == 0.05), NAN) if records else NAN,
           "worker_rss_mib": fleet.ps[0].memory_info().rss / MIB, "database_mib": db_bytes / MIB,
           "invariant_checks": checks, "batches": txn[-1][1] if txn else 0, "disk": disk, "cpu": cpu,
           **{f"batch_txn_p{q}_ms": 1000 * quantile(txn, q / 100) for q in (50, 99)}}
    say(f"minute {minute}: {records:,.0f} records, p99 {row['p99_ms']:.0f} ms, transaction p99 "
        f"{row['batch_txn_p99_ms']:.0f} ms, RSS {row['worker_rss_mib']:.1f} MiB; {cpu_text(cpu)}")
    return row


async def exact_latency(bench: Bench, commits: kit.Commits) -> dict[int, Any]:
    """Per minute of Kafka timestamps, every row's produce -> commit, split at when the worker took it: exact."""
    by_minute: dict[int, tuple[array[float], array[float], array[float]]] = {}  # arrays: 9M rows in 30 minutes
    async with bench.owner() as conn, conn.transaction():
        first = await conn.fetchval("SELECT extract(epoch FROM min(kafka_timestamp))::float8 FROM stock_movements")
        async for p, offset, ts in conn.cursor("""SELECT kafka_partition, kafka_offset,
                                                  extract(epoch FROM kafka_timestamp)::float8 FROM stock_movements""",
                                               prefetch=20_000):
            if (commit := kit.commit_of(commits, p, offset)) is not None:
                total, taken, worker = by_minute.setdefault(int((ts - first) // 60) + 1,
                                                            (array("d"), array("d"), array("d")))
                total.append(1000 * (commit[0] - ts))
                if not math.isnan(commit[1]):
                    taken.append(1000 * (commit[1] - ts))
                    worker.append(1000 * (commit[0] - commit[1]))
    return {m: {**exact_percentiles(total), "to_worker": exact_percentiles(taken),
                "in_worker": exact_percentiles(worker)} for m, (total, taken, worker) in by_minute.items()}


async def measure_soak(bench: Bench, a: argparse.Namespace) -> str:
    if any("=" not in e for e in a.soak_env):
        raise SystemExit("soak: --soak-env takes VAR=VALUE")
    env, meta, vm = dict(e.split("=", 1) for e in a.soak_env), bench.results["meta"], Path("/proc/sys/vm")
    meta["wal_pool"] = prime_wal()
    meta["host_writeback"] = {name: int((vm / name).read_text()) for name in ("dirty_expire_centisecs",
                              "dirty_writeback_centisecs", "dirty_background_bytes", "dirty_background_ratio")
                              if (vm / name).exists()}
    await bench.create_database()
    topic, count = await bench.create_topic("soak"), int(a.rate * 60 * a.minutes)
    fleet, disk = kit.Fleet(bench, topic, f"bench-{bench.run_id}-soak", "soak"), DiskWrites()
    producer: subprocess.Popen[bytes] | None = None
    sampling: asyncio.Task[None] | None = None
    bench.results["soak"] = soak = {"minutes": a.minutes, "rate": a.rate, "movements": count, "per_minute": [],
                                    "worker_env": env}
    fleet.start(1, {"STOCK_LEDGER_LOG_LEVEL": "debug", **env})  # debug: a `batch.committed` line per batch
    try:
        await fleet.wait_claimed(120)
        await asyncio.sleep(1)
        say(f"soak: {count:,} movements at {a.rate:,}/s for {a.minutes:g} min; logs {bench.logs}")
        argv = java_producer(bench.services.kafka, topic, count, str(a.rate)) or [
            sys.executable, "-m", "stock_ledger", "produce", "--count", str(count), "--rate", str(a.rate)]
        with (bench.logs / "producer.log").open("wb") as log:
            producer = subprocess.Popen(argv, env=bench.worker_env(topic, "soak"), stdout=log,  # noqa: ASYNC220
                                        stderr=subprocess.STDOUT)
        before, cpu = scrape(fleet.workers[0].port), CpuShares(fleet.ps[0], psutil.Process(producer.pid))
        started, minute = time.monotonic(), 0
        sampling = asyncio.create_task(disk.run())
        while producer.poll() is None or minute < int(a.minutes):
            minute += 1
            await asyncio.sleep(max(0.0, started + 60 * minute - time.monotonic()))
            fleet.check_alive()
            now = scrape(fleet.workers[0].port)
            soak["per_minute"].append(await minute_row(minute, fleet, (before, now), disk.take(), cpu.take()))
            before = now
        if await asyncio.to_thread(producer.wait, 600) != 0:
            raise RuntimeError(f"the producer failed; see {bench.logs / 'producer.log'}")
        await fleet.wait_drained(await bench.end_offsets(topic), 300)
        soak["worker_rss_end_mib"] = fleet.ps[0].memory_info().rss / MIB
        await fleet.stop()
    finally:
        if sampling is not None:
            sampling.cancel()
        fleet.kill()
        if producer is not None and producer.poll() is None:
            producer.kill()
    exact = await exact_latency(bench, kit.commit_times([fleet.workers[0].log]))
    for row in soak["per_minute"]:
        row["exact"] = exact.get(row["minute"], {"rows": 0})
    soak["verify"] = await verify_measured(bench, topic, fleet.group)
    return render_soak(soak)


def render_soak(result: dict[str, Any]) -> str:
    rows = []
    for row in result["per_minute"]:
        x, to, within = row["exact"], row["exact"].get("to_worker", {}), row["exact"].get("in_worker", {})
        rows.append((row["minute"], f"{x.get('rows', 0):,}", *(f"{x.get(k, NAN):.0f}" for k in (
            "p50_ms", "p95_ms", "p99_ms", "max_ms")), f"{100 * x.get('under_50ms', NAN):.1f}%",
            f"{row['batch_txn_p50_ms']:.0f}/{row['batch_txn_p99_ms']:.0f}", f"{row['worker_rss_mib']:.1f}",
            f"{row['database_mib']:.0f}", f"{(row.get('disk') or {}).get('bursts', NAN):.0f}",
            f"{row['cpu']['host_busy_pct']:.0f}/{row['cpu']['worker_cpu_pct']:.0f}",
            f"{to.get('p99_ms', NAN):.0f}/{within.get('p99_ms', NAN):.0f}",
            ", ".join(f"{k} {1000 * v['seconds']:.0f}" for k, v in row["invariant_checks"].items()) or "-"))
    v, settings = result["verify"], ", ".join(f"{k}={v}" for k, v in result["worker_env"].items())
    return "\n".join([
        (f"soak: {result['movements']:,} movements at {result['rate']:,}/s for {result['minutes']:g} min, one "
         f"worker ({settings or 'default settings'})"),
        kit.table(("minute", "records", "p50 ms", "p95 ms", "p99 ms", "max ms", "<=50ms", "txn p50/p99 ms",
                   "RSS MiB", "DB MiB", "disk bursts", "host/worker CPU %", "p99 to/in worker",
                   "invariant checks (ms)"), rows),
        *(f"minute {row['minute']:>2} CPU: {cpu_text(row['cpu'])}" for row in result["per_minute"]),
        (f"verify at the end: {v['seconds']:.1f} s, peak RSS {v['peak_rss_mib']:.0f} MiB, exit {v['exit_code']}, "
         f"{v['last_line']}")])
