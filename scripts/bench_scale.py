"""The ledger at scale, called by scripts/bench.py: `--verify-sizes N,...` and `--soak MINUTES --rate R`.

verify-sizes  per N: a fresh topic of N records (scripts/FastProducer.java; `--verify-records tiny`: 8-byte
              values, many per record batch, the quickest to produce; `sparse`: valid movements, one per record
              batch, the layout a steady modest rate leaves and the most work per byte for verify's reader) and a
              fresh database preloaded server-side with N movements at the same
              coordinates (generate_series into an UNLOGGED table, so no WAL; the unique indexes built after the
              load, then VACUUM ANALYZE), stock
              levels equal to their sum and every stored offset at the log end. Then `stock-ledger verify` runs as
              a subprocess: wall time and peak RSS (the kernel's ru_maxrss, from wait4 in a small parent of its own, see
              `run_measured`). Then the invariant checks
              (invariants.py): a full pass, then three "minutes" of traffic (R x 60 movements each, appended like
              batches) each followed by an incremental check, timed.
soak          one worker (debug logs: one `batch.committed` line per batch) on a fresh topic and database while
              `stock-ledger produce --rate R` runs for MINUTES; every minute: end-to-end latency quantiles from the
              worker's histogram (the delta over the minute, interpolated in the bucket like histogram_quantile,
              plus the exact share under 50 ms, a bucket bound), worker RSS, database size, invariant check
              durations, the host's disk writes (DiskWrites: the kernel's writeback bursts delay COMMITs; the
              kernel's writeback settings go into the JSON's meta). At the end: exact per-minute p50/p95/p99 per
              row (the batch's commit time from its log line minus the record's Kafka timestamp), then
              `stock-ledger verify`'s time and peak RSS.

Both drop what they create. Preloads run with parallel workers off (one core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from array import array
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import psutil
import structlog
from prometheus_client.parser import text_string_to_metric_families

from stock_ledger.invariants import Invariants
from stock_ledger.sink import stored_offsets

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling harness, run as a script or imported
import localservices

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

ROOT: Final = Path(__file__).resolve().parents[1]
PARTITIONS: Final = 24
MIB: Final = 1024 * 1024
KAFKA_LIBS: Final = Path(os.environ.get("KAFKA_LIBS", Path.home() / ".cache/stock-ledger/kafka-4.1.1/libs"))
E2E: Final = "stock_ledger_end_to_end_latency_seconds"
CHECKS: Final = "stock_ledger_invariant_check_duration_seconds"
BATCH: Final = "stock_ledger_batch_duration_seconds"


def say(message: str) -> None:
    print(f"[bench-scale {datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


@dataclass
class Place:
    """One database and one topic, created for a measurement and dropped after it."""

    kafka: str
    admin_url: str
    worker_url_for: Callable[[str], str]
    owner_url_for: Callable[[str], str]
    label: str
    database: str = ""
    topic: str = ""
    group: str = ""

    async def create(self) -> None:
        run = uuid.uuid4().hex[:8]
        self.database, self.topic = f"sl_scale_{run}_{self.label}", f"warehouse.movements.scale-{run}-{self.label}"
        self.group = f"scale-{run}"
        await localservices.create_migrated_database(self.admin_url, self.database)
        await localservices.create_topic(self.kafka, self.topic, PARTITIONS)

    async def drop(self) -> None:
        if self.database:
            await localservices.drop_database(self.admin_url, self.database)
        if self.topic:
            await localservices.delete_topics(self.kafka, [self.topic])

    @property
    def owner_url(self) -> str:
        return self.owner_url_for(self.database)

    @property
    def worker_url(self) -> str:
        return self.worker_url_for(self.database)

    def env(self, **extra: str) -> dict[str, str]:
        return localservices.worker_env(self.kafka, self.owner_url, self.topic, self.group, **extra)

    async def end_offsets(self) -> dict[int, int]:
        return await localservices.end_offsets(self.kafka, self.topic, PARTITIONS)


# ------------------------------------------------------------------------------------------------ verify at scale


def java_producer(kafka: str, topic: str, count: int, mode: str | None = None) -> list[str] | None:
    """The argv of scripts/FastProducer.java (`mode`: a rate, "sparse", or None for tiny records) on the project's
    Kafka jars; None where Java or the jars are missing."""
    if shutil.which("java") is None or not (KAFKA_LIBS / "kafka-clients-4.1.1.jar").exists():
        return None
    # Paced (the soak's load), the producer shares the host with what it measures: C1 alone and the serial
    # collector compile and collect less while the soak's first minute runs (with the cheaper values of
    # FastProducer.java: 13.0-14.8 CPU-s for 30 s at 20,000/s, JVM start included, against 22.8-26.2 before;
    # docs/bench/pinned-2026-12-02/producer-cpu.txt). Unpaced, C2's faster code is worth its compiling.
    paced = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"] if mode not in {None, "sparse"} else []
    return ["java", "-Xmx256m", *paced, "-cp", f"{KAFKA_LIBS}/*", str(ROOT / "scripts" / "FastProducer.java"), kafka,
            topic, str(count), str(PARTITIONS), *([mode] if mode else [])]


def fast_produce(kafka: str, topic: str, count: int, records: str = "tiny") -> float:
    """N records with the Java client (the project's Kafka jars): `tiny`, 8 bytes each, round robin over the
    partitions, many per record batch; `sparse`, valid movements keyed by SKU, one per record batch. Without Java
    or the jars: stock_ledger.produce (real movements, slower)."""
    started = time.perf_counter()
    argv = java_producer(kafka, topic, count, "sparse" if records == "sparse" else None)
    if argv is None:
        from stock_ledger.produce import produce  # noqa: PLC0415

        asyncio.run(produce(kafka, topic, count, show_progress=False))
        return time.perf_counter() - started
    done = subprocess.run(["nice", *argv], capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"FastProducer exited with {done.returncode} producing {topic}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


_ONE_CORE: Final = ("SET max_parallel_workers_per_gather = 0", "SET max_parallel_maintenance_workers = 0",
                    "SET maintenance_work_mem = '256MB'", "SET synchronous_commit = off")


async def preload(place: Place, ends: dict[int, int]) -> None:
    """stock_movements at exactly the topic's coordinates, stock_levels = their sums, offsets at the log end."""
    conn = await asyncpg.connect(place.owner_url)
    parts, counts = list(ends), [ends[p] for p in ends]
    try:
        for statement in _ONE_CORE:
            await conn.execute(statement)
        # UNLOGGED: the preload writes no WAL (gigabytes at 20M, forcing checkpoints on everyone sharing the
        # server); verify and the invariant checks read it exactly as they read a logged table.
        await conn.execute("ALTER TABLE stock_movements SET UNLOGGED")
        await conn.execute("""ALTER TABLE stock_movements DROP CONSTRAINT stock_movements_coordinates_key,
                                                          DROP CONSTRAINT stock_movements_movement_id_key""")
        await conn.execute("DROP INDEX stock_movements_applied_at_brin")
        for i, (p, n) in enumerate(zip(parts, counts, strict=True)):
            # applied_at follows the offsets, about the 5,000/s of a live ledger, ending now.
            await conn.execute("""
                INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic,
                                             kafka_partition, kafka_offset, kafka_timestamp, applied_at)
                SELECT gen_random_uuid(), 'WH-' || lpad((o % 4)::text, 3, '0'),
                       'SKU-' || lpad(((o * 7919 + $2) % 1000)::text, 6, '0'),
                       CASE WHEN o % 3 = 0 THEN -(o % 100 + 1) ELSE o % 100 + 1 END,
                       CASE WHEN o % 3 = 0 THEN 'pick' ELSE 'receipt' END,
                       t, $1, $2, o, t, t
                  FROM generate_series(0::bigint, $3::bigint - 1) AS o,
                       LATERAL (SELECT now() - ($3 - o) * $4::int * interval '200 microseconds') AS a(t)
            """, place.topic, p, n, PARTITIONS)
            say(f"preload: partition {p} ({i + 1}/{len(parts)}), {n:,} rows")
        say("preload: unique indexes, BRIN, stock_levels, offsets, VACUUM ANALYZE")
        await conn.execute("""ALTER TABLE stock_movements
            ADD CONSTRAINT stock_movements_coordinates_key UNIQUE (kafka_topic, kafka_partition, kafka_offset),
            ADD CONSTRAINT stock_movements_movement_id_key UNIQUE (movement_id)""")
        await conn.execute("CREATE INDEX stock_movements_applied_at_brin ON stock_movements USING brin (applied_at)")
        # went_negative_at: set exactly when on_hand < 0 (a CHECK of migration 0004 keeps the two in step).
        await conn.execute("""INSERT INTO stock_levels (warehouse_id, sku, on_hand, went_negative_at)
                              SELECT warehouse_id, sku, sum(qty), CASE WHEN sum(qty) < 0 THEN now() END
                                FROM stock_movements GROUP BY 1, 2""")
        await conn.execute("""INSERT INTO consumer_offsets (group_id, topic, partition, next_offset)
                              SELECT $1, $2, p, n FROM unnest($3::int[], $4::bigint[]) AS e(p, n)""",
                           place.group, place.topic, parts, counts)
        await conn.execute("VACUUM (ANALYZE) stock_movements")
    finally:
        await conn.close()


# Started by a small interpreter, not by this process: Linux carries the RSS high-water mark of the address space a
# process had before exec into its ru_maxrss, and a child forked or vforked from here starts with ours. Measured
# directly, every verify read at least this bench's own RSS: at the end of a 30-minute soak, the exact latency of 9M
# rows held here (486 MiB read as verify's). The small interpreter's own ~10 MiB is the floor now.
_MEASURE: Final = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
"""


def run_measured(argv: Sequence[str], env: dict[str, str], out: Path) -> dict[str, Any]:
    """Run a command; its wall time, exit code, peak RSS (ru_maxrss of the command alone, from wait4 in a small
    parent of its own) and last stdout line."""
    started = time.perf_counter()
    usage = out.with_suffix(".rusage")
    with out.open("wb") as stdout, out.with_suffix(".err").open("wb") as stderr:
        subprocess.run([sys.executable, "-I", "-c", _MEASURE, str(usage), *argv], env=env, stdout=stdout,
                       stderr=stderr, check=False)
    code, maxrss_kib, cpu = usage.read_text().split()
    lines = out.read_text(errors="replace").splitlines()
    return {"seconds": time.perf_counter() - started, "exit_code": int(code),
            "peak_rss_mib": int(maxrss_kib) / 1024, "last_line": lines[-1] if lines else "",
            "cpu_seconds": float(cpu)}


async def verify_measured(place: Place, logs: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "stock_ledger", "verify"]
    result = await asyncio.to_thread(run_measured, argv, place.env(), logs / f"verify-{place.label}.out")
    say(f"verify: {result['seconds']:.1f}s, peak RSS {result['peak_rss_mib']:.0f} MiB, exit {result['exit_code']}, "
        f"last line {result['last_line']}")
    return result


async def append_minute(conn: asyncpg.Connection, place: Place, per_partition: int) -> None:
    """A minute of traffic as batches write it: rows after each partition's stored offset, the offsets moved and
    the stock levels changed by the rows' sums, in one transaction per round of 1,000 rows a partition."""
    for _ in range(max(1, per_partition // 1000)):
        async with conn.transaction():
            await conn.execute("""
                WITH o AS (SELECT partition AS p, next_offset AS lo FROM consumer_offsets WHERE group_id = $1),
                ins AS (
                  INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic,
                                               kafka_partition, kafka_offset, kafka_timestamp)
                  SELECT gen_random_uuid(), 'WH-' || lpad((x % 4)::text, 3, '0'),
                         'SKU-' || lpad(((x * 7919 + o.p) % 1000)::text, 6, '0'), x % 100 + 1, 'receipt',
                         now(), $2, o.p, x, now()
                    FROM o, generate_series(o.lo, o.lo + 999) AS x
                  RETURNING warehouse_id, sku, qty)
                INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand)
                SELECT warehouse_id, sku, sum(qty) FROM ins GROUP BY 1, 2
                ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + excluded.on_hand,
                    went_negative_at = CASE WHEN l.on_hand + excluded.on_hand < 0
                                            THEN coalesce(l.went_negative_at, now()) END
            """, place.group, place.topic)
            await conn.execute("UPDATE consumer_offsets SET next_offset = next_offset + 1000 WHERE group_id = $1",
                               place.group)


async def invariant_costs(place: Place, rate: int) -> dict[str, Any]:
    conn = await asyncpg.connect(place.owner_url)
    try:
        for statement in _ONE_CORE[:1]:
            await conn.execute(statement)
        checks = Invariants(full_scan_seconds=21_600)
        full = await checks.check(conn, full=True)
        say(f"invariants: full pass {full.seconds:.2f}s (mismatches {full.level_mismatches})")
        incremental = []
        for minute in range(3):
            await append_minute(conn, place, rate * 60 // PARTITIONS)
            checked = await checks.check(conn, full=False)
            incremental.append(checked.seconds)
            say(f"invariants: minute {minute + 1}: incremental check {1000 * checked.seconds:.0f} ms over "
                f"{checked.rows_checked:,} new rows (mismatches {checked.level_mismatches}, "
                f"ahead {checked.partitions_ahead}, unique {checked.coordinates_unique})")
            if checked.level_mismatches or checked.partitions_ahead or not checked.coordinates_unique:
                raise RuntimeError(f"invariants failed on a consistent ledger: {checked}")
    finally:
        await conn.close()
    incremental.sort()
    return {"full_seconds": full.seconds, "incremental_seconds": incremental,
            "incremental_median_seconds": incremental[1]}


async def verify_sizes(kafka: str, admin_url: str, urls: tuple[Callable[[str], str], Callable[[str], str]],  # noqa: PLR0913, PLR0917 - the CLI's flags
                       sizes: Sequence[int], rate: int, records: str = "tiny") -> list[dict[str, Any]]:
    logs = Path(tempfile.mkdtemp(prefix="stock-ledger-scale-"))
    results = []
    try:
        for n in sizes:
            place = Place(kafka, admin_url, urls[1], urls[0], f"n{n}")
            try:
                await place.create()
                say(f"N={n:,}: producing the topic ({place.topic}, {records} records)")
                produce_seconds = await asyncio.to_thread(fast_produce, kafka, place.topic, n, records)
                ends = await place.end_offsets()
                if sum(ends.values()) != n:
                    raise RuntimeError(f"the topic holds {sum(ends.values())} records, expected {n}")
                say(f"N={n:,}: produced in {produce_seconds:.0f}s; preloading the ledger")
                started = time.perf_counter()
                await preload(place, ends)
                preload_seconds = time.perf_counter() - started
                result = await verify_measured(place, logs)
                if result["exit_code"] != 0 or result["last_line"] != f"{n}|{n}":
                    raise RuntimeError(f"verify failed on a consistent ledger: {result}; see {logs}")
                costs = await invariant_costs(place, rate)
                results.append({"movements": n, "records": records, "produce_seconds": produce_seconds,
                                "preload_seconds": preload_seconds, "verify": result, "invariants": costs})
            finally:
                await place.drop()
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return results


# ------------------------------------------------------------------------------------------------ soak


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> labels -> value, from the worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    return found


def buckets(sample: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str,
            where: dict[str, str] | None = None) -> list[tuple[float, float]]:
    """Cumulative (le, count) pairs of a histogram, sorted by le."""
    out = []
    for labels, value in sample.get(f"{name}_bucket", {}).items():
        d = dict(labels)
        if all(d.get(k) == v for k, v in (where or {}).items()):
            out.append((float(d["le"]), value))
    return sorted(out)


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


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank value at quantile q (0 to 1); NaN for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def exact_percentiles(values: array[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"rows": 0}
    return {"rows": len(ordered), "p50_ms": percentile(ordered, 0.5), "p95_ms": percentile(ordered, 0.95),
            "p99_ms": percentile(ordered, 0.99), "max_ms": ordered[-1],
            "under_50ms": sum(1 for v in ordered if v <= 50) / len(ordered)}


def commit_times(logs: Iterable[Path]) -> dict[int, tuple[list[int], list[float], list[float]]]:
    """partition -> (last offsets, commit times, fetch times) of each committed batch, from the worker's debug log.
    The fetch time is when the worker took the batch's records from its consumer (NaN from a worker that does not
    log it)."""
    spans: dict[int, list[tuple[int, float, float]]] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if '"batch.committed"' not in line:
                continue
            event = json.loads(line)
            at = datetime.fromisoformat(event["timestamp"]).timestamp()
            fetched = event.get("fetched")
            for partition, (_first, last, _epoch) in event.get("batch", {}).items():
                spans.setdefault(int(partition), []).append(
                    (int(last), at, float("nan") if fetched is None else float(fetched)))
    for s in spans.values():
        s.sort()
    return {p: ([x[0] for x in s], [x[1] for x in s], [x[2] for x in s]) for p, s in spans.items()}


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


async def soak(kafka: str, admin_url: str, urls: tuple[Callable[[str], str], Callable[[str], str]],  # noqa: PLR0913, PLR0917 - the CLI's flags
               minutes: float, rate: int, worker_env: dict[str, str]) -> dict[str, Any]:
    place = Place(kafka, admin_url, urls[1], urls[0], "soak")
    logs = Path(tempfile.mkdtemp(prefix="stock-ledger-soak-"))
    worker: subprocess.Popen[bytes] | None = None
    producer: subprocess.Popen[bytes] | None = None
    per_minute: list[dict[str, Any]] = []
    disk = DiskWrites()
    try:
        await place.create()
        port = localservices.free_port()
        env = place.env(DATABASE_URL=place.worker_url, STOCK_LEDGER_METRICS_PORT=str(port),
                        STOCK_LEDGER_LOG_LEVEL="debug", **worker_env)
        worker = localservices.spawn_worker(env, logs / "worker.log")
        await wait_claimed(place, worker)
        await asyncio.sleep(1)
        count = int(rate * 60 * minutes)
        say(f"soak: {count:,} movements at {rate:,}/s for {minutes:g} min; worker pid {worker.pid}, logs {logs}")
        producer = spawn(producer_argv(kafka, place.topic, count, rate), place.env(), logs / "producer.log")
        ps = psutil.Process(worker.pid)
        before = scrape(port)
        disk.start()
        cpu = CpuShares(ps, psutil.Process(producer.pid))
        started = time.monotonic()
        minute = 0
        while producer.poll() is None or minute < int(minutes):
            minute += 1
            await asyncio.sleep(max(0.0, started + 60 * minute - time.monotonic()))
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited with {worker.returncode}; see {logs / 'worker.log'}")
            now = scrape(port)
            per_minute.append(await minute_row(minute, place, ps, (before, now), (disk.take(), cpu.take())))
            before = now
            if producer.poll() is not None and minute >= minutes:
                break
        if producer.wait(600) != 0:
            raise RuntimeError(f"the producer failed; see {logs / 'producer.log'}")
        await wait_drained(place)
        rss_end = ps.memory_info().rss / MIB
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        exact = await exact_latency(place, commit_times([logs / "worker.log"]))
        for row in per_minute:
            row["exact"] = exact.get(row["minute"], {"rows": 0})
        verified = await verify_measured(place, logs)
        return {"minutes": minutes, "rate": rate, "movements": count, "per_minute": per_minute,
                "worker_rss_end_mib": rss_end, "verify": verified, "worker_env": worker_env}
    finally:
        disk.stop()
        for proc in (producer, worker):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        await place.drop()
        shutil.rmtree(logs, ignore_errors=True)


def prime_wal() -> str:
    """Start the soak from PostgreSQL's steady state: WAL segments recycled, as after a checkpoint cycle at load,
    not created (and zero-filled) by the batch that needs one, a stall that only a new or restarted cluster has."""
    if os.environ.get("DATABASE_URL"):
        say("the WAL pool is not primed (PostgreSQL from DATABASE_URL): on a new or restarted server, expect a stall "
            "of 50-100 ms every few seconds until its first checkpoints end (README, '30-minute soak')")
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


def producer_argv(kafka: str, topic: str, count: int, rate: int) -> list[str]:
    """The soak's steady load: the Java client when available (it keeps the pace on a busy machine and stamps each
    record when it sends it), else `stock-ledger produce --rate`."""
    return java_producer(kafka, topic, count, str(rate)) or [
        sys.executable, "-m", "stock_ledger", "produce", "--count", str(count), "--rate", str(rate)]


def spawn(argv: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


async def wait_claimed(place: Place, worker: subprocess.Popen[bytes]) -> None:
    conn = await asyncpg.connect(place.owner_url)

    async def claimed() -> bool:
        return len(await stored_offsets(conn, place.group, place.topic)) >= PARTITIONS

    def alive() -> None:
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.returncode} before claiming the partitions")

    try:
        await localservices.wait_until(claimed, 120, "the worker did not claim the partitions within 120 s",
                                       check=alive, every=0.2)
    finally:
        await conn.close()


async def wait_drained(place: Place) -> None:
    ends = await place.end_offsets()
    conn = await asyncpg.connect(place.owner_url)

    async def drained() -> bool:
        stored = await stored_offsets(conn, place.group, place.topic)
        return all((stored.get(p) or 0) >= e for p, e in ends.items())

    try:
        await localservices.wait_until(drained, 300, "the worker did not drain the topic within 300 s", every=0.5)
    finally:
        await conn.close()


async def minute_row(minute: int, place: Place, ps: psutil.Process, scrapes: tuple[dict[str, Any], dict[str, Any]],
                     host: tuple[dict[str, float] | None, dict[str, float | None]]) -> dict[str, Any]:
    before, now = scrapes
    disk, cpu = host
    e2e = delta(buckets(now, E2E), buckets(before, E2E))
    txn = delta(buckets(now, BATCH), buckets(before, BATCH))
    conn = await asyncpg.connect(place.owner_url)
    try:
        db_bytes = int(await conn.fetchval("SELECT pg_database_size(current_database())"))
        rows = sum(n or 0 for n in (await stored_offsets(conn, place.group, place.topic)).values())
        checkpoints = int(await conn.fetchval("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"))
    finally:
        await conn.close()
    checks = {}
    for scope in ("baseline", "incremental", "full"):
        n = now.get(f"{CHECKS}_count", {}).get((("scope", scope),), 0.0) - before.get(
            f"{CHECKS}_count", {}).get((("scope", scope),), 0.0)
        s = now.get(f"{CHECKS}_sum", {}).get((("scope", scope),), 0.0) - before.get(
            f"{CHECKS}_sum", {}).get((("scope", scope),), 0.0)
        if n:
            checks[scope] = {"count": n, "seconds": s}
    row = {"minute": minute, "records": e2e[-1][1] if e2e else 0, "p50_ms": 1000 * quantile(e2e, 0.5),
           "p95_ms": 1000 * quantile(e2e, 0.95), "p99_ms": 1000 * quantile(e2e, 0.99),
           "under_50ms": share_under(e2e, 0.05), "worker_rss_mib": ps.memory_info().rss / MIB,
           "database_mib": db_bytes / MIB, "ledger_rows": rows, "invariant_checks": checks,
           # The batch transaction (COPY + levels + offsets + COMMIT): a record waits for about one cycle before
           # it is fetched and one cycle to be committed, so the latency tail follows this one.
           "batch_txn_p50_ms": 1000 * quantile(txn, 0.5), "batch_txn_p99_ms": 1000 * quantile(txn, 0.99),
           "batches": txn[-1][1] if txn else 0, "checkpoints_total": checkpoints, "disk": disk,
           "cpu": cpu}
    check_text = ", ".join(f"{k} {1000 * v['seconds']:.0f} ms" for k, v in checks.items()) or "none"
    say(f"minute {minute}: {row['records']:,.0f} records, histogram p50 {row['p50_ms']:.0f} ms, p95 "
        f"{row['p95_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, <=50 ms {100 * row['under_50ms']:.1f}%; "
        f"{row['batches']:,.0f} batches, transaction p50 {row['batch_txn_p50_ms']:.0f} ms, p99 "
        f"{row['batch_txn_p99_ms']:.0f} ms; checkpoints so far {checkpoints}; RSS "
        f"{row['worker_rss_mib']:.1f} MiB; database {row['database_mib']:.0f} MiB; checks: {check_text}; "
        f"{disk_text(disk)}; CPU: {cpu_text(cpu)}")
    return row


async def exact_latency(place: Place, commits: dict[int, tuple[list[int], list[float], list[float]]],
                        ) -> dict[int, Any]:
    """Per minute of the soak (by the record's Kafka timestamp): exact quantiles over every row, of produce -> commit
    and of its two parts: produce -> taken by the worker (the producer's linger, the broker, the fetch, the wait for
    the worker's cycle in progress) and taken -> committed (the build and the batch transaction)."""
    import bisect  # noqa: PLC0415

    conn = await asyncpg.connect(place.owner_url)
    by_minute: dict[int, tuple[array[float], array[float], array[float]]] = {}
    try:
        first = await conn.fetchval("SELECT extract(epoch FROM min(kafka_timestamp))::float8 FROM stock_movements")
        async with conn.transaction():
            async for r in conn.cursor("""SELECT kafka_partition, kafka_offset,
                                                 extract(epoch FROM kafka_timestamp)::float8 FROM stock_movements""",
                                       prefetch=20_000):
                lasts, ats, fetched = commits.get(r[0], ([], [], []))
                i = bisect.bisect_left(lasts, r[1])
                if i < len(lasts):
                    total, taken, worker = by_minute.setdefault(
                        int((r[2] - first) // 60) + 1, (array("d"), array("d"), array("d")))
                    total.append(1000 * (ats[i] - r[2]))
                    if not math.isnan(fetched[i]):
                        taken.append(1000 * (fetched[i] - r[2]))
                        worker.append(1000 * (ats[i] - fetched[i]))
    finally:
        await conn.close()
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


def render_soak(result: dict[str, Any]) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in result["worker_env"].items()) or "default settings"
    lines = [(f"soak: {result['movements']:,} movements at {result['rate']:,}/s for {result['minutes']:g} min, one "
             f"worker ({settings})"),
             ("minute  records  p50 ms  p95 ms  p99 ms  max ms  <=50ms  txn p50/p99 ms  RSS MiB  DB MiB  disk bursts  "
              "host/worker CPU %  p99 to/in worker  invariant checks (ms)")]
    for row in result["per_minute"]:
        x = row["exact"]
        checks = ", ".join(f"{k} {1000 * v['seconds']:.0f}" for k, v in row["invariant_checks"].items()) or "-"
        lines.append(f"{row['minute']:>6}  {x.get('rows', 0):>7,}  {x.get('p50_ms', float('nan')):>6.0f}  "
                     f"{x.get('p95_ms', float('nan')):>6.0f}  {x.get('p99_ms', float('nan')):>6.0f}  "
                     f"{x.get('max_ms', float('nan')):>6.0f}  {100 * x.get('under_50ms', float('nan')):>5.1f}%  "
                     f"{row['batch_txn_p50_ms']:>6.0f}/{row['batch_txn_p99_ms']:<6.0f}  {row['worker_rss_mib']:>7.1f}  "
                     f"{row['database_mib']:>6.0f}  {(row.get('disk') or {}).get('bursts', float('nan')):>11.0f}  "
                     f"{row['cpu']['host_busy_pct']:>8.0f}/{row['cpu']['worker_cpu_pct']:<8.0f}  "
                     f"{x.get('to_worker', {}).get('p99_ms', float('nan')):>8.0f}/"
                     f"{x.get('in_worker', {}).get('p99_ms', float('nan')):<7.0f}  {checks}")
    lines += [f"minute {row['minute']:>2} CPU: {cpu_text(row['cpu'])}" for row in result["per_minute"]]
    v = result["verify"]
    lines.append(f"verify at the end: {v['seconds']:.1f} s, peak RSS {v['peak_rss_mib']:.0f} MiB, exit "
                 f"{v['exit_code']}, {v['last_line']}")
    return "\n".join(lines)


def render_sizes(results: Sequence[dict[str, Any]]) -> str:
    lines = ["movements    records  verify s  verify peak RSS MiB  invariants: full s  incremental ms (median of 3)"]
    lines += [f"{r['movements']:>11,}  {r.get('records', 'tiny'):>7}  {r['verify']['seconds']:>8.1f}  "
              f"{r['verify']['peak_rss_mib']:>19.0f}  "
              f"{r['invariants']['full_seconds']:>18.2f}  {1000 * r['invariants']['incremental_median_seconds']:>6.0f}"
              for r in results]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ CLI


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench.py", description="the ledger at scale: " + __doc__.split(
        "\n", 1)[0])
    parser.add_argument("--soak", type=float, default=None, metavar="MINUTES", help="run a soak this long")
    parser.add_argument("--rate", type=int, default=5_000, help="movements/s of the soak, and of the simulated "
                        "minutes of the invariant measurement (default 5,000)")
    parser.add_argument("--soak-env", action="append", default=[], metavar="VAR=VALUE",
                        help="an environment variable for the soak's worker (repeatable), e.g. to compare settings")
    parser.add_argument("--verify-sizes", type=lambda raw: [int(x) for x in raw.split(",") if x.strip()],
                        default=[], metavar="N,...", help="measure verify and the invariant checks at these sizes")
    parser.add_argument("--verify-records", choices=("tiny", "sparse"), default="tiny",
                        help="the topic of --verify-sizes: tiny (8-byte records, many per record batch; quickest to "
                        "produce) or sparse (valid movements, one per record batch: verify's heaviest reading)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default bench-results/scale-<date>.json)")
    args = parser.parse_args(argv)
    if args.soak is None and not args.verify_sizes:
        parser.error("give --soak MINUTES and/or --verify-sizes N,...")
    if (args.soak is not None and args.soak <= 0) or args.rate < 1 or any(n < PARTITIONS for n in args.verify_sizes):
        parser.error(f"--soak must be > 0, --rate >= 1, every --verify-sizes >= {PARTITIONS}")
    if any("=" not in e for e in args.soak_env):
        parser.error("--soak-env takes VAR=VALUE")
    return args


async def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    # stdout is for the tables: the library's own log lines (migrations) go to stderr, warnings and above only.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    services = localservices.discover()
    await localservices.ensure_worker_role(services.admin_url, services.worker_password)
    urls = (services.url_for, lambda db: services.url_for(db, worker=True))
    results: dict[str, Any] = {"meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                                        "cpus": os.cpu_count(), "argv": list(argv),
                                        "load_average_at_start": os.getloadavg()}}
    report = []
    if args.verify_sizes:
        results["verify_sizes"] = await verify_sizes(services.kafka, services.admin_url, urls, args.verify_sizes,
                                                     args.rate, args.verify_records)
        report.append(render_sizes(results["verify_sizes"]))
    if args.soak is not None:
        env = dict(e.split("=", 1) for e in args.soak_env)
        results["meta"]["wal_pool"] = prime_wal()
        results["meta"]["host_writeback"] = writeback = host_writeback()
        expire = writeback["dirty_expire_centisecs"] or 0
        if expire >= 1000:
            say(f"the kernel writes dirty pages back once they are {expire / 100:g} s old: the broker's log goes out "
                f"in bursts that delay a COMMIT about every {expire / 100:g} s (column 'disk bursts'); README, "
                "'30-minute soak', says how to run without them")
        results["soak"] = await soak(services.kafka, services.admin_url, urls, args.soak, args.rate, env)
        report.append(render_soak(results["soak"]))
    results["meta"]["load_average_at_end"] = os.getloadavg()
    out = args.out or ROOT / "bench-results" / f"scale-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("\n\n".join(report))
    say(f"results written to {out}")
    return 0


def run(argv: Sequence[str]) -> int:
    # SIGTERM (a CI timeout, kill) ends the run like Ctrl-C: the finally blocks drop the database and the topic.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return asyncio.run(main(argv))
