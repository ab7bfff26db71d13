"""soak and verify: the ledger under a steady load for minutes, and `stock-ledger verify` at millions of movements.

verify  per --sizes N: a fresh topic of N records (scripts/FastProducer.java; --records tiny: 8-byte values, many
        per record batch, the quickest to produce; sparse: valid movements, one per record batch, the layout a
        steady modest rate leaves and the most work per byte for verify's reader) and a fresh database preloaded
        server-side (UNLOGGED, unique indexes built after the load, one core) with N movements at the same
        coordinates, levels to match and every stored offset at the log end. Then `stock-ledger verify`: wall time
        and peak RSS (ru_maxrss, see `run_measured`); then the invariant checks: a full pass, then three "minutes"
        of traffic (--rate x 60 movements each, appended like batches), each followed by an incremental check.
soak    one worker (debug logs: one `batch.committed` line per batch) on a fresh topic and database while a paced
        producer sends --rate movements/s for --minutes; every minute: latency quantiles from the worker's
        histogram (the minute's delta, interpolated like histogram_quantile; the share under 50 ms, a bucket bound),
        worker RSS, database size, invariant check durations, the host's disk writes and CPU shares (the kernel's
        writeback settings go into the JSON's meta). At the end: exact per-minute p50/p95/p99 over every row
        (its batch's commit time minus its Kafka timestamp), then `stock-ledger verify`'s time and peak RSS.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import subprocess
import sys
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import psutil
from benchkit import (
    CACHE,
    E2E,
    KAFKA_VERSION,
    LEVELS_FROM_MOVEMENTS,
    MIB,
    PARTITIONS,
    ROOT,
    Bench,
    Commits,
    Fleet,
    Metrics,
    buckets,
    bulk_load,
    commit_of,
    commit_times,
    connection,
    ints,
    percentile,
    say,
    scrape,
    table,
)
from localservices import worker_env

from stock_ledger.invariants import Invariants
from stock_ledger.sink import stored_offsets

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence

    import asyncpg

KAFKA_LIBS: Final = Path(os.environ.get("KAFKA_LIBS", CACHE / f"kafka-{KAFKA_VERSION}" / "libs"))
CHECKS: Final = "stock_ledger_invariant_check_duration_seconds"
BATCH_TXN: Final = "stock_ledger_batch_duration_seconds"
_ONE_CORE: Final = ("SET max_parallel_workers_per_gather = 0", "SET max_parallel_maintenance_workers = 0",
                    "SET synchronous_commit = off")


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    p = add("soak", __doc__, measure_soak, "latency, memory and invariant checks under a steady load")
    p.add_argument("--minutes", type=float, required=True, help="how long the producer runs")
    p.add_argument("--rate", type=int, default=5_000, help="movements/s (default 5,000)")
    p.add_argument("--soak-env", action="append", default=[], metavar="VAR=VALUE",
                   help="an environment variable for the worker (repeatable), e.g. to compare settings")
    p = add("verify", __doc__, measure_verify, "`stock-ledger verify` and the invariant checks at N movements")
    p.add_argument("--sizes", type=ints, required=True, help="ledger sizes, e.g. 1000000,20000000")
    p.add_argument("--records", choices=("tiny", "sparse"), default="tiny", help="the topic's records (default tiny)")
    p.add_argument("--rate", type=int, default=5_000, help="movements/s of the simulated minutes (default 5,000)")


def java_producer(kafka: str, topic: str, count: int, mode: str | None = None) -> list[str] | None:
    """The argv of scripts/FastProducer.java (`mode`: a rate, "sparse", or None for tiny records) on the project's
    Kafka jars; None where Java or the jars are missing."""
    if shutil.which("java") is None or not (KAFKA_LIBS / f"kafka-clients-{KAFKA_VERSION}.jar").exists():
        return None
    # Paced (the soak's load), the producer shares the host with what it measures: C1 alone and the serial
    # collector compile and collect less while the soak's first minute runs (13.0-14.8 CPU-s for 30 s at
    # 20,000/s, JVM start included, against 22.8-26.2; docs/bench/pinned-2026-12-02/producer-cpu.txt).
    paced = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"] if mode not in {None, "sparse"} else []
    return ["java", "-Xmx256m", *paced, "-cp", f"{KAFKA_LIBS}/*", str(ROOT / "scripts" / "FastProducer.java"), kafka,
            topic, str(count), str(PARTITIONS), *([mode] if mode else [])]


async def fast_produce(bench: Bench, topic: str, count: int, records: str) -> float:
    """N records with the Java client; without Java or the jars: stock_ledger.produce (real movements, slower)."""
    started = time.perf_counter()
    argv = java_producer(bench.services.kafka, topic, count, "sparse" if records == "sparse" else None)
    if argv is None:
        await bench.produce(topic, count, seed=5)
        return time.perf_counter() - started
    done = await asyncio.to_thread(subprocess.run, ["nice", *argv], capture_output=True, text=True, timeout=3600,
                                   check=False)
    if done.returncode != 0:
        raise RuntimeError(f"FastProducer exited with {done.returncode} producing {topic}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


_AT_COORDINATES: Final = """
INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, kafka_partition,
                             kafka_offset, kafka_timestamp, applied_at)
SELECT gen_random_uuid(), 'WH-' || lpad((o % 4)::text, 3, '0'), 'SKU-' || lpad(((o * 7919 + $2) % 1000)::text, 6, '0'),
       CASE WHEN o % 3 = 0 THEN -(o % 100 + 1) ELSE o % 100 + 1 END, CASE WHEN o % 3 = 0 THEN 'pick' ELSE 'receipt' END,
       t, $1, $2, o, t, t
  FROM generate_series(0::bigint, $3::bigint - 1) AS o,
       LATERAL (SELECT now() - ($3 - o) * $4::int * interval '200 microseconds') AS a(t)
"""


async def preload(conn: asyncpg.Connection, topic: str, group: str, ends: dict[int, int]) -> None:
    """stock_movements at exactly the topic's coordinates (applied_at following the offsets at about the 5,000/s
    of a live ledger, ending now), stock_levels = their sums, offsets at the log end."""
    for statement in _ONE_CORE:
        await conn.execute(statement)
    # UNLOGGED: the preload writes no WAL (gigabytes at 20M, forcing checkpoints on everyone sharing the server);
    # verify and the invariant checks read it exactly as they read a logged table.
    await conn.execute("ALTER TABLE stock_movements SET UNLOGGED")
    await conn.execute("DROP INDEX stock_movements_applied_at_brin")
    await bulk_load(conn, "stock_movements", _AT_COORDINATES, [(topic, p, n, PARTITIONS) for p, n in ends.items()])
    await conn.execute("CREATE INDEX stock_movements_applied_at_brin ON stock_movements USING brin (applied_at)")
    await conn.execute(LEVELS_FROM_MOVEMENTS)
    await conn.execute("""INSERT INTO consumer_offsets (group_id, topic, partition, next_offset)
                          SELECT $1, $2, p, n FROM unnest($3::int[], $4::bigint[]) AS e(p, n)""",
                       group, topic, list(ends), list(ends.values()))
    await conn.execute("VACUUM (ANALYZE) stock_movements")


# Started by a small interpreter, not by this process: Linux carries the RSS high-water mark of the address space a
# process had before exec into its ru_maxrss, and a child forked or vforked from here starts with ours. Measured
# directly, every verify read at least this bench's own RSS (486 MiB after a 30-minute soak). The small
# interpreter's own ~10 MiB is the floor now.
_MEASURE: Final = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
"""


def run_measured(argv: Sequence[str], env: dict[str, str], out: Path) -> dict[str, Any]:
    """Run a command: its wall time, exit code, peak RSS (of the command alone, see _MEASURE), CPU, last stdout line."""
    started = time.perf_counter()
    usage = out.with_suffix(".rusage")
    with out.open("wb") as stdout, out.with_suffix(".err").open("wb") as stderr:
        subprocess.run([sys.executable, "-I", "-c", _MEASURE, str(usage), *argv], env=env, stdout=stdout,
                       stderr=stderr, check=False)
    code, maxrss_kib, cpu = usage.read_text().split()
    lines = out.read_text(errors="replace").splitlines()
    return {"seconds": time.perf_counter() - started, "exit_code": int(code), "peak_rss_mib": int(maxrss_kib) / 1024,
            "last_line": lines[-1] if lines else "", "cpu_seconds": float(cpu)}


async def verify_measured(bench: Bench, topic: str, group: str) -> dict[str, Any]:
    env = worker_env(bench.services.kafka, bench.owner_url, topic, group)
    result = await asyncio.to_thread(run_measured, [sys.executable, "-m", "stock_ledger", "verify"], env,
                                     bench.logs / f"verify-{bench.database}.out")
    say(f"verify: {result['seconds']:.1f}s, peak RSS {result['peak_rss_mib']:.0f} MiB, exit {result['exit_code']}, "
        f"last line {result['last_line']}")
    return result


# A minute of traffic as batches write it: 1,000 rows after each partition's stored offset, the offsets moved and
# the stock levels changed by the rows' sums, in one transaction.
_APPEND: Final = """
WITH o AS (SELECT partition AS p, next_offset AS lo FROM consumer_offsets WHERE group_id = $1),
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


async def invariant_costs(conn: asyncpg.Connection, topic: str, group: str, rate: int) -> dict[str, Any]:
    checks = Invariants(full_scan_seconds=21_600)
    full = await checks.check(conn, full=True)
    say(f"invariants: full pass {full.seconds:.2f}s (mismatches {full.level_mismatches})")
    incremental = []
    for minute in range(3):
        for _ in range(max(1, rate * 60 // PARTITIONS // 1000)):
            async with conn.transaction():
                await conn.execute(_APPEND, group, topic)
                await conn.execute("UPDATE consumer_offsets SET next_offset = next_offset + 1000 WHERE group_id = $1",
                                   group)
        checked = await checks.check(conn, full=False)
        incremental.append(checked.seconds)
        say(f"invariants: minute {minute + 1}: incremental check {1000 * checked.seconds:.0f} ms over "
            f"{checked.rows_checked:,} new rows")
        if checked.level_mismatches or checked.partitions_ahead or not checked.coordinates_unique:
            raise RuntimeError(f"invariants failed on a consistent ledger: {checked}")
    incremental.sort()
    return {"full_seconds": full.seconds, "incremental_seconds": incremental,
            "incremental_median_seconds": incremental[1]}


async def measure_verify(bench: Bench, a: argparse.Namespace) -> str:
    results = bench.results["verify_sizes"] = []
    for n in a.sizes:
        database = await bench.create_database(f"n{n}")
        topic, group = await bench.create_topic(f"n{n}"), f"bench-{bench.run_id}-n{n}"
        say(f"N={n:,}: producing the topic ({topic}, {a.records} records)")
        produce_seconds = await fast_produce(bench, topic, n, a.records)
        ends = await bench.end_offsets(topic)
        if sum(ends.values()) != n:
            raise RuntimeError(f"the topic holds {sum(ends.values())} records, expected {n}")
        say(f"N={n:,}: produced in {produce_seconds:.0f}s; preloading the ledger")
        started = time.perf_counter()
        async with bench.owner() as conn:
            await preload(conn, topic, group, ends)
        preload_seconds = time.perf_counter() - started
        verified = await verify_measured(bench, topic, group)
        if verified["exit_code"] != 0 or verified["last_line"] != f"{n}|{n}":
            raise RuntimeError(f"verify failed on a consistent ledger: {verified}; see {bench.logs}")
        async with bench.owner() as conn:
            await conn.execute(_ONE_CORE[0])
            costs = await invariant_costs(conn, topic, group, a.rate)
        results.append({"movements": n, "records": a.records, "produce_seconds": produce_seconds,
                        "preload_seconds": preload_seconds, "verify": verified, "invariants": costs})
        await bench.drop_database(database)
        await bench.delete_topic(topic)
    return table(("movements", "records", "verify s", "verify peak RSS MiB", "invariants: full s",
                  "incremental ms (median of 3)"),
                 ((f"{r['movements']:,}", r["records"], f"{r['verify']['seconds']:.1f}",
                   f"{r['verify']['peak_rss_mib']:.0f}", f"{r['invariants']['full_seconds']:.2f}",
                   f"{1000 * r['invariants']['incremental_median_seconds']:.0f}") for r in results))


def quantile(cumulative: Sequence[tuple[float, float]], q: float) -> float:
    """histogram_quantile: linear interpolation inside the bucket that holds quantile q."""
    if not cumulative or cumulative[-1][1] <= 0:
        return float("nan")
    rank, prev_le, prev_n = q * cumulative[-1][1], 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return prev_le


def delta(now: Sequence[tuple[float, float]], before: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    old = dict(before)
    return [(le, n - old.get(le, 0.0)) for le, n in now]


def share_under(cumulative: Sequence[tuple[float, float]], bound: float) -> float:
    total = cumulative[-1][1] if cumulative else 0.0
    return next((n / total for le, n in cumulative if le == bound), float("nan")) if total else float("nan")


def exact_percentiles(values: array[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"rows": 0}
    return {"rows": len(ordered), "p50_ms": percentile(ordered, 0.5), "p95_ms": percentile(ordered, 0.95),
            "p99_ms": percentile(ordered, 0.99), "max_ms": ordered[-1],
            "under_50ms": sum(1 for v in ordered if v <= 50) / len(ordered)}


class DiskWrites:
    """The host's disk writes, sampled every 100 ms (Linux /sys/block, whole disks only). The kernel writes other
    processes' dirty pages back in bursts, by default those older than 30 s (vm.dirty_expire_centisecs) on a 5-s
    timer: with the broker on this host, its log segments go out as one burst of 30-100 MiB about every 30.7 s,
    and a COMMIT's WAL flush queued behind it takes 45-95 ms. Per minute: the largest 100-ms write and the count
    of bursts, so a soak's tail can be told apart from the worker's own."""

    PERIOD: Final = 0.1
    BURST_MIB: Final = 8.0

    def __init__(self) -> None:
        self.disks = [d / "stat" for d in sorted(Path("/sys/block").glob("*")) if (d / "device").exists()]
        self.steps: list[float] = []
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def written_mib(self) -> float:
        # /sys/block/<disk>/stat: the 7th field is sectors written, in 512-byte units whatever the device's own.
        return sum(int(f.read_text().split()[6]) for f in self.disks) * 512 / MIB

    async def run(self) -> None:
        if not self.disks:
            return
        last = self.written_mib()
        while True:
            await asyncio.sleep(self.PERIOD)
            now = self.written_mib()
            self.steps.append(now - last)
            last = now

    def take(self) -> dict[str, float] | None:
        """The minute since the last call, and start the next one."""
        steps, self.steps = self.steps, []
        if not steps:
            return None
        return {"written_mib": sum(steps), "max_mib_per_100ms": max(steps),
                "bursts": sum(s >= self.BURST_MIB for s in steps)}


class CpuShares:
    """Per minute, the share of the host's CPU time that was busy, stolen by the hypervisor, and where it went: the
    worker, the producer, this host's PostgreSQL processes (every backend, the checkpointer, the WAL writer) and
    Kafka broker, each in % of one core (None where no such process runs here, e.g. services from the environment).
    A slow minute with the host busier and the worker not is the host's, not the worker's."""

    def __init__(self, worker: psutil.Process, producer: psutil.Process | None = None) -> None:
        self.own = {"worker": worker, "producer": producer}
        self.host, self.spent = psutil.cpu_times(), self._by_process()

    def _by_process(self) -> dict[tuple[int, float], tuple[str, float]]:
        """CPU seconds so far of each process that counts, keyed by (pid, start time): a reused pid is new."""
        named = {p.pid: name for name, p in self.own.items() if p is not None}
        spent = {}
        for proc in psutil.process_iter(["name", "cmdline", "cpu_times", "create_time"]):
            info = proc.info
            if info["cpu_times"] is None:  # gone, or not ours to read
                continue
            name = named.get(proc.pid) or ("postgres" if info["name"] in {"postgres", "postmaster"} else
                                           "broker" if "kafka.Kafka" in (info["cmdline"] or ()) else None)
            if name is not None:
                spent[proc.pid, info["create_time"]] = (name, info["cpu_times"].user + info["cpu_times"].system)
        return spent

    def take(self) -> dict[str, float | None]:
        host, spent = psutil.cpu_times(), self._by_process()
        # guest and guest_nice are already inside user and nice: counting them again would inflate the total.
        times = {f: getattr(host, f) - getattr(self.host, f) for f in host._fields if not f.startswith("guest")}
        total = sum(times.values()) or 1.0
        idle = times.get("idle", 0.0) + times.get("iowait", 0.0)
        # A process started during the minute counts whole; one that ended during it is lost (short-lived
        # connections: the bench's own, once a minute).
        shares: dict[str, float | None] = dict.fromkeys(("worker", "producer", "postgres", "broker"))
        for key, (name, seconds) in spent.items():
            shares[name] = (shares[name] or 0.0) + seconds - self.spent.get(key, (name, 0.0))[1]
        self.host, self.spent = host, spent
        core = total / psutil.cpu_count()
        return {"host_busy_pct": 100 * (total - idle) / total, "steal_pct": 100 * times.get("steal", 0.0) / total,
                **{f"{name}_cpu_pct": None if s is None else 100 * s / core for name, s in shares.items()}}


def host_writeback() -> dict[str, int | None]:
    """When the kernel writes other processes' dirty pages back (see DiskWrites)."""
    def read(name: str) -> int | None:
        try:
            return int(Path("/proc/sys/vm", name).read_text())
        except (OSError, ValueError):
            return None
    return {name: read(name) for name in ("dirty_expire_centisecs", "dirty_writeback_centisecs",
                                          "dirty_background_bytes", "dirty_background_ratio")}


def prime_wal() -> str:
    """Start the soak from PostgreSQL's steady state: WAL segments recycled, as after a checkpoint cycle at load,
    not created (and zero-filled) by the batch that needs one, a stall that only a new or restarted cluster has."""
    if os.environ.get("DATABASE_URL"):
        say("the WAL pool is not primed (PostgreSQL from DATABASE_URL): on a new or restarted server, expect a stall "
            "of 50-100 ms every few seconds until its first checkpoints end")
        return "not primed: PostgreSQL from DATABASE_URL"
    lines = []
    with subprocess.Popen(["bash", str(ROOT / "scripts" / "postgres.sh"), "prime-wal"], stderr=subprocess.PIPE,
                          stdout=subprocess.DEVNULL, text=True) as proc:
        for line in proc.stderr or ():  # its progress, as it comes
            sys.stderr.write(line)
            lines.append(line.strip())
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/postgres.sh prime-wal failed ({proc.returncode}): {' '.join(lines[-3:])}")
    return lines[-1] if lines else "primed"


async def minute_row(minute: int, fleet: Fleet, scrapes: tuple[Metrics, Metrics],
                     host: tuple[dict[str, float] | None, dict[str, float | None]]) -> dict[str, Any]:
    before, now = scrapes
    disk, cpu = host
    e2e = delta(buckets(now, E2E), buckets(before, E2E))
    txn = delta(buckets(now, BATCH_TXN), buckets(before, BATCH_TXN))
    async with fleet.bench.owner() as conn:
        db_bytes = int(await conn.fetchval("SELECT pg_database_size(current_database())"))
        rows = sum(n or 0 for n in (await stored_offsets(conn, fleet.group, fleet.topic)).values())
        checkpoints = int(await conn.fetchval("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"))
    checks = {}
    for scope in ("baseline", "incremental", "full"):
        key = (("scope", scope),)
        n = now.get(f"{CHECKS}_count", {}).get(key, 0.0) - before.get(f"{CHECKS}_count", {}).get(key, 0.0)
        s = now.get(f"{CHECKS}_sum", {}).get(key, 0.0) - before.get(f"{CHECKS}_sum", {}).get(key, 0.0)
        if n:
            checks[scope] = {"count": n, "seconds": s}
    row = {"minute": minute, "records": e2e[-1][1] if e2e else 0, "p50_ms": 1000 * quantile(e2e, 0.5),
           "p95_ms": 1000 * quantile(e2e, 0.95), "p99_ms": 1000 * quantile(e2e, 0.99),
           "under_50ms": share_under(e2e, 0.05), "worker_rss_mib": fleet.procs[0].ps.memory_info().rss / MIB,
           "database_mib": db_bytes / MIB, "ledger_rows": rows, "invariant_checks": checks,
           # The batch transaction (COPY + levels + offsets + COMMIT): a record waits for about one cycle before
           # it is fetched and one cycle to be committed, so the latency tail follows this one.
           "batch_txn_p50_ms": 1000 * quantile(txn, 0.5), "batch_txn_p99_ms": 1000 * quantile(txn, 0.99),
           "batches": txn[-1][1] if txn else 0, "checkpoints_total": checkpoints, "disk": disk, "cpu": cpu}
    check_text = ", ".join(f"{k} {1000 * v['seconds']:.0f} ms" for k, v in checks.items()) or "none"
    say(f"minute {minute}: {row['records']:,.0f} records, histogram p50 {row['p50_ms']:.0f} ms, p95 "
        f"{row['p95_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, <=50 ms {100 * row['under_50ms']:.1f}%; "
        f"{row['batches']:,.0f} batches, transaction p50 {row['batch_txn_p50_ms']:.0f} ms, p99 "
        f"{row['batch_txn_p99_ms']:.0f} ms; checkpoints so far {checkpoints}; RSS {row['worker_rss_mib']:.1f} MiB; "
        f"database {row['database_mib']:.0f} MiB; checks: {check_text}; {disk_text(disk)}; CPU: {cpu_text(cpu)}")
    return row


async def exact_latency(owner_url: str, commits: Commits) -> dict[int, Any]:
    """Per minute of the soak (by the record's Kafka timestamp): exact quantiles over every row, of produce -> commit
    and of its two parts: produce -> taken by the worker (the producer's linger, the broker, the fetch, the wait for
    the worker's cycle in progress) and taken -> committed (the build and the batch transaction)."""
    by_minute: dict[int, tuple[array[float], array[float], array[float]]] = {}
    async with connection(owner_url) as conn, conn.transaction():
        first = await conn.fetchval("SELECT extract(epoch FROM min(kafka_timestamp))::float8 FROM stock_movements")
        async for r in conn.cursor("""SELECT kafka_partition, kafka_offset,
                                             extract(epoch FROM kafka_timestamp)::float8 FROM stock_movements""",
                                   prefetch=20_000):
            if (commit := commit_of(commits, r[0], r[1])) is not None:
                at, fetched = commit
                total, taken, worker = by_minute.setdefault(
                    int((r[2] - first) // 60) + 1, (array("d"), array("d"), array("d")))
                total.append(1000 * (at - r[2]))
                if not math.isnan(fetched):
                    taken.append(1000 * (fetched - r[2]))
                    worker.append(1000 * (at - fetched))
    return {m: {**exact_percentiles(total), "to_worker": exact_percentiles(taken),
                "in_worker": exact_percentiles(worker)} for m, (total, taken, worker) in by_minute.items()}


def disk_text(disk: dict[str, float] | None) -> str:
    if disk is None:
        return "disk writes not sampled (no /sys/block)"
    return (f"disk {disk['written_mib']:.0f} MiB written, at most {disk['max_mib_per_100ms']:.0f} MiB in 100 ms, "
            f"{disk['bursts']:.0f} bursts >= {DiskWrites.BURST_MIB:.0f} MiB")


def cpu_text(cpu: dict[str, float | None]) -> str:
    def share(name: str) -> str:
        value = cpu.get(f"{name}_cpu_pct")
        return "-" if value is None else f"{value:.0f}"
    return (f"host {cpu['host_busy_pct']:.0f}% busy ({cpu['steal_pct']:.0f}% stolen); % of a core: worker "
            f"{share('worker')}, PostgreSQL {share('postgres')}, broker {share('broker')}, "
            f"producer {share('producer')}")


async def measure_soak(bench: Bench, a: argparse.Namespace) -> str:
    if any("=" not in e for e in a.soak_env):
        raise SystemExit("soak: --soak-env takes VAR=VALUE")
    env = dict(e.split("=", 1) for e in a.soak_env)
    bench.results["meta"]["wal_pool"] = prime_wal()
    bench.results["meta"]["host_writeback"] = writeback = host_writeback()
    if (expire := writeback["dirty_expire_centisecs"] or 0) >= 1000:
        say(f"the kernel writes dirty pages back once they are {expire / 100:g} s old: the broker's log goes out in "
            f"bursts that delay a COMMIT about every {expire / 100:g} s (column 'disk bursts')")
    await bench.create_database()
    topic = await bench.create_topic("soak")
    fleet = Fleet(bench, topic, f"bench-{bench.run_id}-soak", "soak")
    count = int(a.rate * 60 * a.minutes)
    producer: subprocess.Popen[bytes] | None = None
    disk = DiskWrites()
    per_minute: list[dict[str, Any]] = []
    bench.results["soak"] = soak = {"minutes": a.minutes, "rate": a.rate, "movements": count,
                                    "per_minute": per_minute, "worker_env": env}
    fleet.start(1, {"STOCK_LEDGER_LOG_LEVEL": "debug", **env})
    try:
        await fleet.wait_claimed(120)
        await asyncio.sleep(1)
        say(f"soak: {count:,} movements at {a.rate:,}/s for {a.minutes:g} min; logs {bench.logs}")
        argv = java_producer(bench.services.kafka, topic, count, str(a.rate)) or [
            sys.executable, "-m", "stock_ledger", "produce", "--count", str(count), "--rate", str(a.rate)]
        with (bench.logs / "producer.log").open("wb") as log:
            producer = subprocess.Popen(  # noqa: ASYNC220 - started, not waited for
                argv, env=worker_env(bench.services.kafka, bench.owner_url, topic, "soak"), stdout=log,
                stderr=subprocess.STDOUT)
        before = scrape(fleet.procs[0].worker.port)
        disk.start()
        cpu = CpuShares(fleet.procs[0].ps, psutil.Process(producer.pid))
        started, minute = time.monotonic(), 0
        while producer.poll() is None or minute < int(a.minutes):
            minute += 1
            await asyncio.sleep(max(0.0, started + 60 * minute - time.monotonic()))
            fleet.check_alive()
            now = scrape(fleet.procs[0].worker.port)
            per_minute.append(await minute_row(minute, fleet, (before, now), (disk.take(), cpu.take())))
            before = now
        if await asyncio.to_thread(producer.wait, 600) != 0:
            raise RuntimeError(f"the producer failed; see {bench.logs / 'producer.log'}")
        await fleet.wait_drained(await bench.end_offsets(topic), 300)
        soak["worker_rss_end_mib"] = fleet.procs[0].ps.memory_info().rss / MIB
        await fleet.stop()
    finally:
        disk.stop()
        fleet.kill()
        if producer is not None and producer.poll() is None:
            producer.kill()
    exact = await exact_latency(bench.owner_url, commit_times([fleet.procs[0].worker.log]))
    for row in per_minute:
        row["exact"] = exact.get(row["minute"], {"rows": 0})
    soak["verify"] = await verify_measured(bench, topic, fleet.group)
    return render_soak(soak)


def render_soak(result: dict[str, Any]) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in result["worker_env"].items()) or "default settings"
    nan = float("nan")
    rows = []
    for row in result["per_minute"]:
        x, to, within = row["exact"], row["exact"].get("to_worker", {}), row["exact"].get("in_worker", {})
        rows.append((row["minute"], f"{x.get('rows', 0):,}", *(f"{x.get(k, nan):.0f}" for k in (
            "p50_ms", "p95_ms", "p99_ms", "max_ms")), f"{100 * x.get('under_50ms', nan):.1f}%",
            f"{row['batch_txn_p50_ms']:.0f}/{row['batch_txn_p99_ms']:.0f}", f"{row['worker_rss_mib']:.1f}",
            f"{row['database_mib']:.0f}", f"{(row.get('disk') or {}).get('bursts', nan):.0f}",
            f"{row['cpu']['host_busy_pct']:.0f}/{row['cpu']['worker_cpu_pct']:.0f}",
            f"{to.get('p99_ms', nan):.0f}/{within.get('p99_ms', nan):.0f}",
            ", ".join(f"{k} {1000 * v['seconds']:.0f}" for k, v in row["invariant_checks"].items()) or "-"))
    v = result["verify"]
    return "\n".join([
        (f"soak: {result['movements']:,} movements at {result['rate']:,}/s for {result['minutes']:g} min, one "
         f"worker ({settings})"),
        table(("minute", "records", "p50 ms", "p95 ms", "p99 ms", "max ms", "<=50ms", "txn p50/p99 ms", "RSS MiB",
               "DB MiB", "disk bursts", "host/worker CPU %", "p99 to/in worker", "invariant checks (ms)"), rows),
        *(f"minute {row['minute']:>2} CPU: {cpu_text(row['cpu'])}" for row in result["per_minute"]),
        (f"verify at the end: {v['seconds']:.1f} s, peak RSS {v['peak_rss_mib']:.0f} MiB, exit {v['exit_code']}, "
         f"{v['last_line']}")])
