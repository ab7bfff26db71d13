"""The kit of `python -m scripts.bench`: a run's scratch databases and topics (`Bench`), real worker processes
draining them with their memory and CPU sampled (`Fleet`), bulk loads, the worker's commit log, medians, tables,
the machine a result was measured on, a bar chart."""

import asyncio
import bisect
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import distributions
from pathlib import Path
from typing import Any, Final

import asyncpg
import psutil
from aiokafka import TopicPartition
from tests.support import services as local
from tests.support.services import Services, WorkerProcess, start_worker, stop_workers, wait_until

from stock_ledger.audit.invariants import LEVEL_MISMATCHES
from stock_ledger.cli import args as cli
from stock_ledger.clients import kafka
from stock_ledger.config import Settings, load_settings
from stock_ledger.ledger.batch import Record
from stock_ledger.ledger.offsets import stored_offsets

ROOT: Final = Path(__file__).resolve().parents[1]
PARTITIONS: Final = 24
BATCH: Final = Settings().batch_max_records  # the worker's default STOCK_LEDGER_BATCH_MAX_RECORDS
MIB: Final = 1024 * 1024
MISMATCH_COUNT: Final = f"SELECT count(*) FROM ({LEVEL_MISMATCHES}) AS m"  # the invariant checks' own definition
# stock_levels made to match the movements; went_negative_at set exactly when on_hand < 0 (migration 0004's CHECK).
LEVELS_FROM_MOVEMENTS: Final = """
INSERT INTO stock_levels (warehouse_id, sku, on_hand, went_negative_at)
SELECT warehouse_id, sku, sum(qty), CASE WHEN sum(qty) < 0 THEN now() END FROM stock_movements GROUP BY 1, 2
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = excluded.on_hand, went_negative_at = excluded.went_negative_at
"""
STARTED: Final = time.monotonic()
DRAIN_SECONDS: Final = 900.0  # the longest a drain may take before the run fails
# The broker's version, as scripts/kafka.sh pins it unless KAFKA_VERSION is set.
KAFKA_VERSION: Final = os.environ.get("KAFKA_VERSION") or (ROOT / "scripts" / "kafka.sh").read_text().split(
    'KAFKA_VERSION="${KAFKA_VERSION:-', 1)[-1].split("}", 1)[0]
CACHE: Final = Path(os.environ.get("STOCK_LEDGER_CACHE", Path.home() / ".cache" / "stock-ledger"))
Commits = dict[int, tuple[list[int], list[float], list[float]]]


def say(message: str) -> None:
    print(f"[bench {time.monotonic() - STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def connection(url: str, **options: Any) -> AsyncIterator[asyncpg.Connection]:  # noqa: ANN401 - asyncpg's
    conn = await asyncpg.connect(url, **options)
    try:
        yield conn
    finally:
        await conn.close()


@dataclass
class Bench:
    """One run: its scratch databases and topics, the workers' logs, what it measured so far, its charts."""

    services: Services
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    database: str = ""  # the last one created, which the run is using
    databases: list[str] = field(default_factory=list)
    topics: list[str] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="stock-ledger-bench-")))
    keep_logs: bool = False
    results: dict[str, Any] = field(default_factory=lambda: {"meta": {}})
    charts: dict[str, str] = field(default_factory=dict)

    def owner(self, **options: Any) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:  # noqa: ANN401
        return connection(self.services.url_for(self.database), **options)

    async def create_database(self, label: str = "main") -> str:
        self.database = f"sl_bench_{self.run_id}_{label}"
        await local.create_migrated_database(self.services.admin_url, self.database)
        self.databases.append(self.database)
        say(f"database {self.database} created and migrated")
        return self.database

    async def drop_database(self, name: str) -> None:
        await local.drop_database(self.services.admin_url, name)
        self.databases.remove(name)

    async def create_topic(self, label: str, partitions: int = PARTITIONS) -> str:
        name = f"warehouse.movements.bench-{self.run_id}-{label}"
        await local.create_topic(self.services.kafka, name, partitions)
        self.topics.append(name)
        return name

    async def delete_topic(self, name: str) -> None:
        await local.delete_topics(self.services.kafka, [name])
        self.topics.remove(name)

    async def close(self) -> None:
        """Drop what the run created; the logs stay only after a failure."""
        for name in list(self.databases):
            await self.drop_database(name)
        await local.delete_topics(self.services.kafka, self.topics)
        if self.keep_logs:
            say(f"worker logs kept in {self.logs}")
        else:
            shutil.rmtree(self.logs, ignore_errors=True)

    async def versions(self) -> dict[str, str]:
        async with connection(self.services.admin_url) as conn:
            postgres = str(await conn.fetchval("SHOW server_version"))
        kafka = f"{KAFKA_VERSION} (scripts/kafka.sh)" if self.services.origin == "scripts" else "unknown"
        return {"postgresql": postgres, "kafka": kafka, "origin": self.services.origin}

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return await local.end_offsets(self.services.kafka, topic, PARTITIONS)

    async def read_topic(self, topic: str) -> list[Record]:
        """Every committed record of `topic` up to its log end now, as the worker reads them (read_committed)."""
        ends, kept = await self.end_offsets(topic), []
        consumer = kafka.reader(load_settings({"KAFKA_BOOTSTRAP_SERVERS": self.services.kafka}))
        await consumer.start()
        try:
            consumer.assign(tps := [TopicPartition(topic, p) for p in range(PARTITIONS)])
            await consumer.seek_to_beginning(*tps)
            while any([await consumer.position(tp) < ends[tp.partition] for tp in tps]):
                for records in (await consumer.getmany(timeout_ms=1000, max_records=BATCH)).values():
                    kept += [Record(r.partition, r.offset, r.timestamp, r.key, r.value) for r in records]
        finally:
            await consumer.stop()
        return kept

    async def produce(self, topic: str, count: int, seed: int) -> dict[str, float]:
        say(f"producing {count:,} movements to {topic}")
        started = time.perf_counter()
        await local.produce(self.services.kafka, topic, count, seed=seed, show_progress=True)
        if (held := sum((await self.end_offsets(topic)).values())) != count:
            raise RuntimeError(f"{topic} holds {held} records, expected {count}")
        seconds = time.perf_counter() - started
        return {"produce_seconds": seconds, "produce_rate": count / seconds}

    def worker_env(self, topic: str, group: str, **extra: str) -> dict[str, str]:
        url = self.services.url_for(self.database, worker=True)
        return local.worker_env(self.services.kafka, url, topic, group, **extra)

    async def reset_ledger(self) -> None:
        async with self.owner() as conn:
            await conn.execute("TRUNCATE stock_movements, rejected_movements, consumer_offsets, stock_levels, "
                               "non_record_offsets")

    async def worker(  # noqa: PLR0913 - the drains differ in these
        self, topic: str, label: str, workers: int = 1, env: dict[str, str] | None = None, *,
        load: Callable[["Fleet"], Awaitable[None]] | None = None, fresh: bool = True, rows: int | None = None,
    ) -> "Fleet":
        """`workers` processes draining `topic` and what `load` adds, timed and costed in `Fleet.result`; `rows`:
        the movements that makes (default one per offset; fewer on a topic written in producer transactions)."""
        if fresh:
            await self.reset_ledger()
        fleet = Fleet(self, topic, f"bench-{self.run_id}-{label}", label)
        fleet.start(workers, env or {})
        try:
            ends = await self.end_offsets(topic)
            if load is not None:
                await load(fleet)
                ends = await self.end_offsets(topic)
            await fleet.wait_drained(ends, DRAIN_SECONDS)
        except BaseException:
            self.keep_logs = True
            fleet.kill()
            raise
        await fleet.stop()
        async with self.owner() as conn:
            held = await conn.fetchval("SELECT count(*) FROM stock_movements WHERE kafka_topic = $1", topic)
            rejected = await conn.fetchval("SELECT count(*) FROM rejected_movements")
        if (held, rejected) != (count := sum(ends.values()) if rows is None else rows, 0):
            raise RuntimeError(f"{label}: the ledger holds {held} movements and {rejected} rejects, expected {count}")
        seconds, steady = fleet.drained - fleet.started, fleet.drained - (fleet.first_commit or fleet.started)
        r = fleet.result = {"seconds": seconds, "rate": count / seconds, "steady_rate": count / steady if steady else 0,
                            "peak_rss_mib": max(fleet.peak_rss) / MIB, "cpu_seconds": sum(fleet.cpu),
                            "cpu_seconds_per_100k": sum(fleet.cpu) / count * 100_000}
        say(f"worker x{workers} ({label}): {count:,} at {r['rate']:,.0f}/s (steady {r['steady_rate']:,.0f}/s), peak "
            f"RSS {r['peak_rss_mib']:.0f} MiB, {r['cpu_seconds_per_100k']:.2f} CPU s per 100k")
        return fleet


@dataclass
class Fleet:
    """Workers sharing one group on one topic; their peak RSS and CPU (user + sys), sampled at every check."""

    bench: Bench
    topic: str
    group: str
    label: str
    workers: list[WorkerProcess] = field(default_factory=list)
    ps: list[psutil.Process] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    started: float = 0.0
    first_commit: float | None = None
    drained: float = 0.0
    result: dict[str, float] = field(default_factory=dict)

    def start(self, workers: int, extra_env: dict[str, str]) -> None:
        self.started = time.perf_counter()
        for i in range(workers):
            self.workers.append(start_worker(self.bench.worker_env(self.topic, self.group, **extra_env),
                                             self.bench.logs / f"{self.label}-{i}.log"))
            self.ps.append(psutil.Process(self.workers[-1].pid))
        self.peak_rss, self.cpu = [0] * workers, [0.0] * workers

    def check_alive(self) -> None:
        """Sample each worker's RSS and CPU, then raise if one has exited."""
        for i, ps in enumerate(self.ps):
            with contextlib.suppress(psutil.Error):
                self.peak_rss[i], times = max(self.peak_rss[i], ps.memory_info().rss), ps.cpu_times()
                self.cpu[i] = times.user + times.system
        check_alive(self.workers)

    async def wait_claimed(self, within: float) -> None:
        async with self.bench.owner() as conn:
            async def claimed() -> bool:
                return len(await stored_offsets(conn, self.group, self.topic)) >= PARTITIONS

            await wait_until(claimed, within, f"the worker did not claim the partitions within {within:g}s",
                             check=self.check_alive)

    async def wait_drained(self, ends: dict[int, int], within: float) -> None:
        async def applied() -> int:  # the records up to `ends` the group has stored offsets past
            stored = await stored_offsets(conn, self.group, self.topic)
            return sum(min(stored.get(p) or 0, end) for p, end in ends.items())

        async with self.bench.owner() as conn:
            self.first_commit, self.drained = await timed_until(applied, sum(ends.values()), within, self.label,
                                                                self.check_alive)

    async def stop(self) -> None:
        self.check_alive()
        await stop_workers(self.workers, 30)

    def kill(self) -> None:
        for w in self.workers:
            w.kill()  # a no-op on one that has exited


def check_alive(workers: Iterable[WorkerProcess]) -> None:
    """Raise, with the end of its log, if one of `workers` (any process) has exited."""
    for w in workers:
        if not w.alive():
            raise RuntimeError(f"{w.log} ended: exit {w.proc.returncode}; its last lines:\n{w.log_tail(30)}")


async def timed_until(progress: Callable[[], Awaitable[int]], total: int, within: float, label: str,
                      check: Callable[[], None]) -> tuple[float, float]:
    """Poll `progress` until it reaches `total`, `check` between polls: when it first moved and when it got there."""
    started, first, last_say = time.perf_counter(), None, time.perf_counter()
    while (done := await progress()) < total:
        now = time.perf_counter()
        first = first or (now if done else None)
        check()
        if now - started > within:
            raise RuntimeError(f"{label}: not done after {within:g}s: {done:,}/{total:,}")
        if now - last_say > 5:
            last_say = now
            say(f"  {label}: {done:,}/{total:,}, {done / (now - started):,.0f}/s")
        await asyncio.sleep(0.1)
    now = time.perf_counter()
    return first or now, now


# Segments of stock_movements for rows loaded by hand (migrations/0014_segments.sql): partitions, highest offsets.
SEGMENTS: Final = "SELECT count(*) FROM stock_ledger_ensure_segments($1::int[], $2::bigint[])"


async def bulk_load(conn: asyncpg.Connection, table: str, statement: str, chunks: Iterable[tuple[Any, ...]], *,
                    maintenance_work_mem: str = "256MB") -> None:
    """`statement` per chunk's arguments, the table's unique constraints dropped: a sort builds them back faster."""
    await conn.execute(f"SET maintenance_work_mem = '{maintenance_work_mem}'")
    constraints = await conn.fetch("SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                                   "WHERE conrelid = $1::regclass AND contype = 'u'", table)
    for name, _ in constraints:
        await conn.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
    started = time.perf_counter()
    for i, args in enumerate(chunks):
        await conn.execute(statement, *args)
        say(f"  bulk load of {table}: chunk {i + 1} ({time.perf_counter() - started:.0f}s)")
    for name, definition in constraints:
        await conn.execute(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}')


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank value at quantile q (0 to 1); NaN for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def commit_times(logs: Iterable[Path]) -> Commits:
    """partition -> (last offsets, commit times, fetch times) of its batches, from `batch.committed` debug lines."""
    spans: dict[int, list[tuple[int, float, float]]] = {}
    for line in (line for log in logs for line in log.read_text(errors="replace").splitlines()):
        if '"batch.committed"' in line:
            event = json.loads(line)
            at, fetched = datetime.fromisoformat(event["timestamp"]).timestamp(), event.get("fetched")
            for partition, (_first, last, _epoch) in event.get("batch", {}).items():
                spans.setdefault(int(partition), []).append(
                    (int(last), at, float("nan") if fetched is None else float(fetched)))
    return {p: tuple(map(list, zip(*sorted(s), strict=True))) for p, s in spans.items()}


def commit_of(commits: Commits, partition: int, offset: int) -> tuple[float, float] | None:
    """(commit time, fetch time) of the batch that committed this record; None where no log line says."""
    lasts, ats, fetched = commits.get(partition, ([], [], []))
    i = bisect.bisect_left(lasts, offset)
    return (ats[i], fetched[i]) if i < len(lasts) else None


def prefixed(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {prefix + k: v for k, v in values.items()}


def median_of(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over repeated runs (keys of the first run)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def ints(raw: str) -> list[int]:
    """A comma-separated list of integers (an argparse type)."""
    return [int(x) for x in raw.split(",") if x.strip()]


def table(head: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """The CLI's table, the first column left-aligned and the others right-aligned."""
    return cli.table(head, list(rows), frozenset(range(1, len(head))))


def environment(options: dict[str, Any]) -> dict[str, Any]:
    """The machine and the versions a result was measured with, and the run's options."""
    named = ("stock-ledger", "aiokafka", "asyncpg", "msgspec", "uvloop", "psutil")
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(), "cpus": os.cpu_count(),
        "cpu_model": model or platform.processor() or "unknown",
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1), "platform": platform.platform(),
        "python": platform.python_version(), "load_average": os.getloadavg(),
        "versions": {d.name: d.version for d in distributions() if d.name in named},
        "options": {k: (str(x) if isinstance(x, Path) else x) for k, x in options.items() if not callable(x)},
    }


def bar_svg(title: str, bars: Sequence[tuple[str, float]], x_label: str,
            lines: Sequence[tuple[float, str]] = ()) -> str:
    """A bar chart without a plotting dependency: one labelled bar per value, optional dashed reference lines."""
    width, height, left, bottom, top = 640, 360, 80, 50, 40
    top_value = max([v for _, v in bars] + [v for v, _ in lines] + [1.0]) * 1.15
    slot, base = (width - left - 20) / max(1, len(bars)), height - bottom

    def y(value: float) -> float:
        return top + (base - top) * (1 - value / top_value)

    def text(x: float, y: float, body: object, anchor: str = "middle", extra: str = "") -> str:
        return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{body}</text>'

    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
              f'font-size="12"><rect width="{width}" height="{height}" fill="white"/>'),
             text(width / 2, 22, title, extra=' font-size="14"'), text(width / 2, height - 12, x_label),
             f'<line x1="{left}" y1="{base}" x2="{width - 20}" y2="{base}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{base}" stroke="black"/>',
             *(text(left - 6, y(top_value * i / 4) + 4, f"{top_value * i / 4:,.0f}", "end") for i in range(5))]
    for i, (label, value) in enumerate(bars):
        x = left + i * slot + slot * 0.2
        parts += [(f'<rect x="{x:.1f}" y="{y(value):.1f}" width="{slot * 0.6:.1f}" height="{base - y(value):.1f}" '
                   'fill="#4878a8"/>'), text(x + slot * 0.3, y(value) - 4, f"{value:,.0f}"),
                  text(x + slot * 0.3, base + 16, label)]
    for value, label in lines:
        parts += [(f'<line x1="{left}" y1="{y(value):.1f}" x2="{width - 20}" y2="{y(value):.1f}" stroke="#c04040" '
                   'stroke-dasharray="6 4"/>'), text(width - 22, y(value) - 5, label, "end", ' fill="#c04040"')]
    return "\n".join([*parts, "</svg>"]) + "\n"
