"""The kit of scripts/bench.py's subcommands: a run's scratch databases and topics (`Bench`), real worker processes
draining them with their memory and CPU sampled (`Fleet`; `localservices.WorkerProcess`, the tests' type), bulk
loads, the worker's metrics and commit log, medians, tables, the machine a result was measured on, a bar chart.
"""

from __future__ import annotations

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
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import psutil
from prometheus_client.parser import text_string_to_metric_families

from stock_ledger.config import Settings
from stock_ledger.produce import produce
from stock_ledger.sink import stored_offsets

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling harness, run as a script or imported
import localservices
from localservices import Services, WorkerProcess, start_worker, stop_workers, wait_until

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence

ROOT: Final = Path(__file__).resolve().parents[1]
PARTITIONS: Final = 24
BATCH: Final = Settings().batch_max_records  # the worker's default STOCK_LEDGER_BATCH_MAX_RECORDS
MIB: Final = 1024 * 1024
E2E: Final = "stock_ledger_end_to_end_latency_seconds"
LEDGER_TABLES: Final = "stock_movements, rejected_movements, consumer_offsets, stock_levels"
# Pairs whose stored level is not the sum of their movements: 0 on a consistent ledger.
LEVEL_MISMATCHES: Final = """
SELECT count(*) FROM (SELECT warehouse_id, sku, sum(qty) AS total FROM stock_movements GROUP BY 1, 2) AS m
  FULL JOIN stock_levels AS l USING (warehouse_id, sku) WHERE coalesce(m.total, 0) <> coalesce(l.on_hand, 0)
"""
# stock_levels made to match the movements; went_negative_at set exactly when on_hand < 0 (migration 0004's CHECK).
LEVELS_FROM_MOVEMENTS: Final = """
INSERT INTO stock_levels (warehouse_id, sku, on_hand, went_negative_at)
SELECT warehouse_id, sku, sum(qty), CASE WHEN sum(qty) < 0 THEN now() END FROM stock_movements GROUP BY 1, 2
ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = excluded.on_hand, went_negative_at = excluded.went_negative_at
"""
STARTED: Final = time.monotonic()
# The broker version and the cache of scripts/kafka.sh: its pinned default unless KAFKA_VERSION is set, like there.
KAFKA_VERSION: Final = os.environ.get("KAFKA_VERSION") or (ROOT / "scripts" / "kafka.sh").read_text().split(
    'KAFKA_VERSION="${KAFKA_VERSION:-', 1)[-1].split("}", 1)[0]
CACHE: Final = Path(os.environ.get("STOCK_LEDGER_CACHE", Path.home() / ".cache" / "stock-ledger"))
Metrics = dict[str, dict[tuple[tuple[str, str], ...], float]]
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
    """One run: its scratch databases and topics on the services, the workers' logs, and what it measured so far
    (`results`, kept as <out>-partial.json when the run fails; `charts`, SVGs written beside --out)."""

    services: Services
    timeout: float = 900.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    databases: list[str] = field(default_factory=list)
    topics: list[str] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="stock-ledger-bench-")))
    keep_logs: bool = False
    results: dict[str, Any] = field(default_factory=lambda: {"meta": {}})
    charts: dict[str, str] = field(default_factory=dict)

    @property
    def database(self) -> str:
        return self.databases[-1]

    @property
    def owner_url(self) -> str:
        return self.services.url_for(self.database)

    def owner(self) -> contextlib.AbstractAsyncContextManager[asyncpg.Connection]:
        return connection(self.owner_url)

    async def create_database(self, label: str = "main") -> str:
        name = f"sl_bench_{self.run_id}_{label}"
        await localservices.create_migrated_database(self.services.admin_url, name)
        self.databases.append(name)
        say(f"database {name} created and migrated")
        return name

    async def drop_database(self, name: str) -> None:
        await localservices.drop_database(self.services.admin_url, name)
        self.databases.remove(name)

    async def create_topic(self, label: str, partitions: int = PARTITIONS) -> str:
        name = f"warehouse.movements.bench-{self.run_id}-{label}"
        await localservices.create_topic(self.services.kafka, name, partitions)
        self.topics.append(name)
        return name

    async def delete_topic(self, name: str) -> None:
        await localservices.delete_topics(self.services.kafka, [name])
        self.topics.remove(name)

    async def close(self) -> None:
        """Drop what the run created; the logs stay only after a failure."""
        for name in list(self.databases):
            await self.drop_database(name)
        await localservices.delete_topics(self.services.kafka, self.topics)
        if self.keep_logs:
            say(f"worker logs kept in {self.logs}")
        else:
            shutil.rmtree(self.logs, ignore_errors=True)

    async def versions(self) -> dict[str, str]:
        async with connection(self.services.admin_url) as conn:
            postgres = str(await conn.fetchval("SHOW server_version"))
        kafka = f"{KAFKA_VERSION} (scripts/kafka.sh)" if self.services.origin == "scripts" else (
            "unknown (KAFKA_BOOTSTRAP_SERVERS)")
        return {"postgresql": postgres, "kafka": kafka, "origin": self.services.origin}

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return await localservices.end_offsets(self.services.kafka, topic, PARTITIONS)

    async def produce(self, topic: str, count: int, seed: int) -> dict[str, float]:
        say(f"producing {count:,} movements to {topic}")
        started = time.perf_counter()
        await produce(self.services.kafka, topic, count, seed=seed, show_progress=True)
        ends = await self.end_offsets(topic)
        if sum(ends.values()) != count:
            raise RuntimeError(f"{topic} holds {sum(ends.values())} records, expected {count}")
        seconds = time.perf_counter() - started
        return {"produce_seconds": seconds, "produce_rate": count / seconds}

    def worker_env(self, topic: str, group: str, **extra: str) -> dict[str, str]:
        url = self.services.url_for(self.database, worker=True)
        return localservices.worker_env(self.services.kafka, url, topic, group, **extra)

    async def reset_ledger(self) -> None:
        async with self.owner() as conn:
            await conn.execute(f"TRUNCATE {LEDGER_TABLES}")

    async def run_workers(  # noqa: PLR0913 - the drains differ in these, keyword-only past the first four
        self, topic: str, label: str, workers: int = 1, extra_env: dict[str, str] | None = None,
        while_running: Callable[[Fleet], Coroutine[Any, Any, None]] | None = None, *, fresh: bool = True,
    ) -> Fleet:
        """Start `workers` worker processes and wait until they drain `topic` (on an empty ledger unless `fresh`
        is False: then on top of whatever it holds); a failure kills them and keeps their logs."""
        if fresh:
            await self.reset_ledger()
        fleet = Fleet(self, topic, f"bench-{self.run_id}-{label}", label)
        ends = await self.end_offsets(topic)
        fleet.start(workers, extra_env or {})
        try:
            if while_running is not None:
                await while_running(fleet)
                ends = await self.end_offsets(topic)
            await fleet.wait_drained(ends, self.timeout)
        except BaseException:
            self.keep_logs = True
            fleet.kill()
            raise
        await fleet.stop()
        await fleet.verify(sum(ends.values()))
        return fleet

    async def worker(self, topic: str, label: str, workers: int, count: int, *, fresh: bool = True,
                     **extra: str) -> dict[str, float]:
        """The drain of `count` movements by `workers` processes, timed and costed (`Fleet.summary`)."""
        say(f"worker x{workers} ({label}): draining {count:,} movements")
        result = (await self.run_workers(topic, label, workers, extra, fresh=fresh)).summary(count)
        say(f"worker x{workers} ({label}): {count:,} in {result['seconds']:.1f}s ({result['rate']:,.0f}/s, "
            f"steady {result['steady_rate']:,.0f}/s), peak RSS {result['peak_rss_mib']:.0f} MiB, "
            f"{result['cpu_seconds_per_100k']:.2f} CPU s per 100k")
        return result


@dataclass
class Proc:
    """One worker of a fleet and what it cost: peak RSS and CPU (user + sys), sampled."""

    worker: WorkerProcess
    ps: psutil.Process
    peak_rss: int = 0
    cpu: float = 0.0

    def sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.peak_rss = max(self.peak_rss, self.ps.memory_info().rss)
            times = self.ps.cpu_times()
            self.cpu = times.user + times.system


@dataclass
class Fleet:
    """Worker processes sharing one group on one topic: spawn, wait for the claim or the drain, stop, check."""

    bench: Bench
    topic: str
    group: str
    label: str
    procs: list[Proc] = field(default_factory=list)
    started: float = 0.0
    first_commit: float | None = None
    drained: float = 0.0
    metrics: Metrics = field(default_factory=dict)
    _sampler: asyncio.Task[None] | None = None

    def start(self, workers: int, extra_env: dict[str, str]) -> None:
        self.started = time.perf_counter()
        for i in range(workers):
            env = self.bench.worker_env(self.topic, self.group, **extra_env)
            worker = start_worker(env, self.bench.logs / f"{self.label}-{i}.log")
            self.procs.append(Proc(worker, psutil.Process(worker.pid)))
        self._sampler = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            for p in self.procs:
                p.sample()
            await asyncio.sleep(0.1)

    def check_alive(self) -> None:
        check_alive(p.worker for p in self.procs)

    async def wait_claimed(self, within: float) -> None:
        async with self.bench.owner() as conn:
            async def claimed() -> bool:
                return len(await stored_offsets(conn, self.group, self.topic)) >= PARTITIONS

            await wait_until(claimed, within, f"the worker did not claim the partitions within {within:g}s",
                             check=self.check_alive)

    async def wait_drained(self, ends: dict[int, int], within: float) -> None:
        async with self.bench.owner() as conn:
            self.first_commit, self.drained = await timed_until(lambda: applied(conn, self.group, self.topic, ends),
                                                                sum(ends.values()), within, self.label,
                                                                self.check_alive)

    async def stop(self) -> None:
        for p in self.procs:
            p.sample()
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        with contextlib.suppress(OSError):
            self.metrics = await asyncio.to_thread(scrape, self.procs[0].worker.port)
        await stop_workers([p.worker for p in self.procs], 30)

    def kill(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
        for p in self.procs:
            if p.worker.alive():
                p.worker.kill()

    async def verify(self, expected: int) -> None:
        async with self.bench.owner() as conn:
            rows = await conn.fetchval("SELECT count(*) FROM stock_movements WHERE kafka_topic = $1", self.topic)
            rejected = await conn.fetchval("SELECT count(*) FROM rejected_movements")
        if (rows, rejected) != (expected, 0):
            raise RuntimeError(f"{self.label}: ledger holds {rows} movements and {rejected} rejects, "
                               f"expected {expected} and 0")

    def summary(self, count: int) -> dict[str, float]:
        seconds = self.drained - self.started
        steady = self.drained - (self.first_commit or self.started)
        cpu = sum(p.cpu for p in self.procs)
        return {"seconds": seconds, "rate": count / seconds, "steady_rate": count / steady if steady > 0 else 0.0,
                "peak_rss_mib": max(p.peak_rss for p in self.procs) / MIB, "cpu_seconds": cpu,
                "cpu_seconds_per_100k": cpu / count * 100_000}


def check_alive(workers: Iterable[WorkerProcess]) -> None:
    """Raise, with the end of its log, if one of `workers` has exited."""
    for w in workers:
        if not w.alive():
            raise RuntimeError(f"worker {w.log.name} exited with {w.proc.returncode}:\n{w.log_tail(20)}")


async def applied(conn: asyncpg.Connection, group: str, topic: str, ends: dict[int, int]) -> int:
    """How many of the records up to `ends` (partition -> log end) the group has stored offsets past."""
    stored = await stored_offsets(conn, group, topic)
    return sum(min(stored.get(p) or 0, end) for p, end in ends.items())


async def timed_until(progress: Callable[[], Awaitable[int]], total: int, within: float, label: str,
                      check: Callable[[], None]) -> tuple[float | None, float]:
    """Poll `progress` every 100 ms until it reaches `total`, saying how far it got every 5 s; when it first moved
    and when it got there (perf_counter). `check` between polls raises if the system under test died."""
    started, first = time.perf_counter(), None
    deadline, last_say = time.monotonic() + within, time.monotonic()
    while (done := await progress()) < total:
        now = time.perf_counter()
        first = first or (now if done else None)
        check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{label}: not done after {within:g}s: {done:,}/{total:,}")
        if time.monotonic() - last_say > 5:
            last_say = time.monotonic()
            say(f"  {label}: {done:,}/{total:,}, {done / (now - started):,.0f}/s")
        await asyncio.sleep(0.1)
    now = time.perf_counter()
    return first or now, now


async def bulk_load(conn: asyncpg.Connection, table: str, statement: str, chunks: Iterable[tuple[Any, ...]], *,
                    maintenance_work_mem: str = "256MB") -> None:
    """Run `statement` once per chunk's arguments with the table's unique constraints dropped, then add them back
    as declared (built by a sort): several times faster than maintaining random-UUID indexes row by row."""
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
    say(f"  bulk load of {table}: unique constraints rebuilt")


def scrape(port: int) -> Metrics:
    """name -> labels -> value, from the worker's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    found: Metrics = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = float(s.value)
    return found


def buckets(sample: Metrics, name: str) -> list[tuple[float, float]]:
    """Cumulative (le, count) pairs of a histogram, sorted by le."""
    return sorted((float(dict(labels)["le"]), value) for labels, value in sample.get(f"{name}_bucket", {}).items())


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank value at quantile q (0 to 1); NaN for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def commit_times(logs: Iterable[Path]) -> Commits:
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
    """Columns as wide as their widest cell: the first left-aligned, the others right-aligned."""
    cells = [list(head), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                   strict=True)))
                     for row in cells)


def environment(options: dict[str, Any]) -> dict[str, Any]:
    def v(dist: str) -> str:
        try:
            return version(dist)
        except Exception:
            return "absent"

    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": round(psutil.virtual_memory().total / 1024**3, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "versions": {d: v(d) for d in ("stock-ledger", "aiokafka", "asyncpg", "msgspec", "uvloop", "psutil")},
        "options": {k: (str(x) if isinstance(x, Path) else x) for k, x in options.items() if not callable(x)},
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def bar_svg(title: str, bars: Sequence[tuple[str, float]], x_label: str,
            lines: Sequence[tuple[float, str]] = ()) -> str:
    """A hand-written bar chart (no plotting dependency): one labelled bar per value, optional reference lines."""
    width, height, left, bottom, top = 640, 360, 80, 50, 40
    top_value = max([v for _, v in bars] + [v for v, _ in lines] + [1.0]) * 1.15
    plot_h, slot, base = height - bottom - top, (width - left - 20) / max(1, len(bars)), height - bottom

    def y(value: float) -> float:
        return top + plot_h * (1 - value / top_value)

    def text(x: float, y: float, body: object, anchor: str = "middle", extra: str = "") -> str:
        return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{body}</text>'

    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12"><rect width="{width}" height="{height}" fill="white"/>'),
             text(width / 2, 22, title, extra=' font-size="14"'), text(width / 2, height - 12, x_label),
             f'<line x1="{left}" y1="{base}" x2="{width - 20}" y2="{base}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{base}" stroke="black"/>']
    parts += [text(left - 6, y(top_value * i / 4) + 4, f"{top_value * i / 4:,.0f}", "end") for i in range(5)]
    for i, (label, value) in enumerate(bars):
        x = left + i * slot + slot * 0.2
        parts += [(f'<rect x="{x:.1f}" y="{y(value):.1f}" width="{slot * 0.6:.1f}" height="{base - y(value):.1f}" '
                  'fill="#4878a8"/>'), text(x + slot * 0.3, y(value) - 4, f"{value:,.0f}"),
                  text(x + slot * 0.3, base + 16, label)]
    for value, label in lines:
        parts += [(f'<line x1="{left}" y1="{y(value):.1f}" x2="{width - 20}" y2="{y(value):.1f}" stroke="#c04040" '
                  'stroke-dasharray="6 4"/>'), text(width - 22, y(value) - 5, label, "end", ' fill="#c04040"')]
    return "\n".join([*parts, "</svg>"]) + "\n"
