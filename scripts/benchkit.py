"""What the benches share on top of the local services: one run's scratch database and topics with the real worker
draining them (`Bench`), a fleet of worker processes with their memory and CPU sampled (`Fleet`), progress lines,
the machine a result was measured on, a bar chart and the partial results of a failed run.

Used by scripts/bench.py, ledger_bench.py, peer_bench.py and membership_bench.py; each keeps only its own
measurements, tables and CLI. Processes, services, databases and topics come from scripts/localservices.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import psutil

from stock_ledger.config import Settings
from stock_ledger.produce import produce
from stock_ledger.sink import stored_offsets

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling harness, run as a script or imported
import localservices
from bench_scale import scrape
from localservices import Services, WorkerProcess, start_worker, stop_workers, wait_until

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Sequence

ROOT: Final = Path(__file__).resolve().parents[1]
PARTITIONS: Final = 24
DEFAULT_BATCH: Final = Settings().batch_max_records  # the worker's default STOCK_LEDGER_BATCH_MAX_RECORDS
MIB: Final = 1024 * 1024
LEDGER_TABLES: Final = "stock_movements, rejected_movements, consumer_offsets, stock_levels"
STARTED: Final = time.monotonic()


def say(message: str) -> None:
    print(f"[bench {time.monotonic() - STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def run_on_uvloop(main: Coroutine[Any, Any, int]) -> int:
    """Run a bench's `main`: on uvloop where installed, because the worker runs on it, so the limits are measured
    on it too."""
    try:
        import uvloop  # noqa: PLC0415 - optional on some platforms
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


# ------------------------------------------------------------------------------------------------ one run


@dataclass
class Options:
    """scripts/bench.py's options; the other benches fill in theirs, and every result records them under
    `meta.options`."""

    count: int
    naive_count: int
    repeat: int
    latency_seconds: float
    latency_rate: int
    batch_max_records: int | None
    batch_sizes: list[int]
    workers: int
    timeout: float
    out: Path
    svg: Path | None

    @classmethod
    def drains_only(cls, count: int, repeat: int, timeout: float, out: Path) -> Options:
        """A bench that only drains with the real worker (ledger_bench, peer_bench): the fields of bench.py's own
        measurements stay at the values their results have always recorded."""
        return cls(count, 1, repeat, 0, 1, None, [], 1, timeout, out, None)


@dataclass
class Bench:
    """One run: its scratch database and topics on the services, the workers' logs, and the drains."""

    services: Services
    opts: Options
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    database: str = ""
    topics: list[str] = field(default_factory=list)
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="stock-ledger-bench-")))
    keep_logs: bool = False

    @property
    def owner_url(self) -> str:
        return self.services.url_for(self.database)

    @property
    def worker_url(self) -> str:
        return self.services.url_for(self.database, worker=True)

    @property
    def batch(self) -> int:
        return self.opts.batch_max_records or DEFAULT_BATCH

    # -------------------------------------------------------------------------------- setup / teardown

    async def create_database(self) -> None:
        self.database = f"sl_bench_{self.run_id}"
        await localservices.create_migrated_database(self.services.admin_url, self.database)
        say(f"database {self.database} created and migrated")

    async def drop_database(self) -> None:
        if self.database:
            await localservices.drop_database(self.services.admin_url, self.database)

    async def create_topic(self, label: str) -> str:
        name = f"warehouse.movements.bench-{self.run_id}-{label}"
        await localservices.create_topic(self.services.kafka, name, PARTITIONS)
        self.topics.append(name)
        return name

    async def delete_topics(self) -> None:
        await localservices.delete_topics(self.services.kafka, self.topics)

    async def owner(self) -> asyncpg.Connection:
        return await asyncpg.connect(self.owner_url)

    async def versions(self) -> dict[str, str]:
        conn = await self.owner()
        try:
            postgres = str(await conn.fetchval("SHOW server_version"))
        finally:
            await conn.close()
        kafka = "unknown (KAFKA_BOOTSTRAP_SERVERS)"
        if self.services.origin == "scripts":
            script = (ROOT / "scripts" / "kafka.sh").read_text()
            default = script.split('KAFKA_VERSION="${KAFKA_VERSION:-', 1)[-1].split("}", 1)[0]
            kafka = f"{os.environ.get('KAFKA_VERSION', default)} (scripts/kafka.sh)"
        return {"postgresql": postgres, "kafka": kafka, "origin": self.services.origin}

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return await localservices.end_offsets(self.services.kafka, topic, PARTITIONS)

    async def produce(self, topic: str, count: int, seed: int) -> dict[str, float]:
        say(f"producing {count:,} movements to {topic}")
        started = time.perf_counter()
        await produce(self.services.kafka, topic, count, seed=seed, show_progress=True)
        seconds = time.perf_counter() - started
        return {"produce_seconds": seconds, "produce_rate": count / seconds}

    # -------------------------------------------------------------------------------- the worker

    def worker_env(self, topic: str, group: str, extra: dict[str, str]) -> dict[str, str]:
        size = self.opts.batch_max_records
        batch = {"STOCK_LEDGER_BATCH_MAX_RECORDS": str(size)} if size else {}
        return localservices.worker_env(self.services.kafka, self.worker_url, topic, group, **batch, **extra)

    async def reset_ledger(self) -> None:
        conn = await self.owner()
        try:
            await conn.execute(f"TRUNCATE {LEDGER_TABLES}")
        finally:
            await conn.close()

    async def run_workers(  # noqa: PLR0913 - the drains differ in these, keyword-only past the first four
        self, topic: str, label: str, workers: int = 1, extra_env: dict[str, str] | None = None,
        while_running: Callable[[Fleet], Coroutine[Any, Any, None]] | None = None, *,
        group: str | None = None, fresh: bool = True,
    ) -> Fleet:
        """Start `workers` worker processes and wait until they drain `topic` (on an empty ledger unless `fresh`
        is False: then on top of whatever it holds); a failure kills them and keeps their logs."""
        if fresh:
            await self.reset_ledger()
        fleet = Fleet(self, topic, group or f"bench-{self.run_id}-{label}", label)
        ends = await self.end_offsets(topic)
        fleet.start(workers, extra_env or {})
        try:
            if while_running is not None:
                await while_running(fleet)
                ends = await self.end_offsets(topic)
            await fleet.wait_drained(ends, self.opts.timeout)
        except BaseException:
            self.keep_logs = True
            fleet.kill()
            raise
        await fleet.stop()
        await fleet.verify(sum(ends.values()))
        return fleet

    async def worker(self, topic: str, label: str, workers: int, count: int,
                     extra_env: dict[str, str] | None = None) -> dict[str, float]:
        say(f"worker x{workers} ({label}): draining {count:,} movements")
        fleet = await self.run_workers(topic, label, workers, extra_env)
        result = fleet.summary(count)
        say(f"worker x{workers} ({label}): {count:,} in {result['seconds']:.1f}s ({result['rate']:,.0f}/s, "
            f"steady {result['steady_rate']:,.0f}/s), peak RSS {result['peak_rss_mib']:.0f} MiB, "
            f"{result['cpu_seconds_per_100k']:.2f} CPU s per 100k")
        return result


# ------------------------------------------------------------------------------------------------ workers


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
    bench: Bench
    topic: str
    group: str
    label: str
    procs: list[Proc] = field(default_factory=list)
    started: float = 0.0
    first_commit: float | None = None
    drained: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    _sampler: asyncio.Task[None] | None = None

    def start(self, workers: int, extra_env: dict[str, str]) -> None:
        self.started = time.perf_counter()
        for i in range(workers):
            env = self.bench.worker_env(self.topic, self.group, extra_env)
            worker = start_worker(env, self.bench.logs / f"{self.label}-{i}.log")
            self.procs.append(Proc(worker, psutil.Process(worker.pid)))
        self._sampler = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        while True:
            for p in self.procs:
                p.sample()
            await asyncio.sleep(0.1)

    def _check_alive(self) -> None:
        for p in self.procs:
            if not p.worker.alive():
                raise RuntimeError(f"worker {p.worker.log.name} exited with {p.worker.proc.returncode}:\n"
                                   f"{p.worker.log_tail(20)}")

    async def wait_claimed(self, within: float) -> None:
        conn = await self.bench.owner()

        async def claimed() -> bool:
            return len(await stored_offsets(conn, self.group, self.topic)) >= PARTITIONS

        try:
            await wait_until(claimed, within, f"the worker did not claim the partitions within {within:g}s",
                             check=self._check_alive)
        finally:
            await conn.close()

    async def wait_drained(self, ends: dict[int, int], within: float) -> None:
        total = sum(ends.values())
        conn = await self.bench.owner()
        deadline = time.monotonic() + within
        last_say = time.monotonic()
        try:
            while True:
                stored = await stored_offsets(conn, self.group, self.topic)
                applied = sum(min(stored.get(p) or 0, end) for p, end in ends.items())
                now = time.perf_counter()
                if applied and self.first_commit is None:
                    self.first_commit = now
                if applied >= total:
                    self.drained = now
                    return
                self._check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not drained after {within:g}s: {applied:,}/{total:,}")
                if time.monotonic() - last_say > 5:
                    last_say = time.monotonic()
                    say(f"  {self.label}: {applied:,}/{total:,} applied, {applied / (now - self.started):,.0f}/s")
                await asyncio.sleep(0.1)
        finally:
            await conn.close()

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
        conn = await self.bench.owner()
        try:
            rows = await conn.fetchval("SELECT count(*) FROM stock_movements WHERE kafka_topic = $1", self.topic)
            rejected = await conn.fetchval("SELECT count(*) FROM rejected_movements")
        finally:
            await conn.close()
        if (rows, rejected) != (expected, 0):
            raise RuntimeError(f"{self.label}: ledger holds {rows} movements and {rejected} rejects, "
                               f"expected {expected} and 0")

    def summary(self, count: int) -> dict[str, float]:
        seconds = self.drained - self.started
        steady = self.drained - (self.first_commit or self.started)
        cpu = sum(p.cpu for p in self.procs)
        return {
            "seconds": seconds,
            "rate": count / seconds,
            "steady_rate": count / steady if steady > 0 else 0.0,
            "peak_rss_mib": max(p.peak_rss for p in self.procs) / MIB,
            "cpu_seconds": cpu,
            "cpu_seconds_per_100k": cpu / count * 100_000,
        }


# ------------------------------------------------------------------------------------------------ results


def median_of(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over repeated runs (keys of the first run)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def environment(opts: Options) -> dict[str, Any]:
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
        "versions": {d: v(d) for d in ("stock-ledger", "aiokafka", "asyncpg", "msgspec", "uvloop", "psutil")},
        "options": {k: (str(x) if isinstance(x, Path) else x) for k, x in vars(opts).items()},
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
    plot_h, slot = height - bottom - top, (width - left - 20) / max(1, len(bars))

    def y(value: float) -> float:
        return top + plot_h * (1 - value / top_value)

    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">'),
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>',
             f'<line x1="{left}" y1="{top + plot_h}" x2="{width - 20}" y2="{top + plot_h}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="black"/>']
    for i in range(5):
        value = top_value * i / 4
        parts.append(f'<text x="{left - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{value:,.0f}</text>')
    for i, (label, value) in enumerate(bars):
        x = left + i * slot + slot * 0.2
        parts += [
            (f'<rect x="{x:.1f}" y="{y(value):.1f}" width="{slot * 0.6:.1f}" height="{top + plot_h - y(value):.1f}" '
            'fill="#4878a8"/>'),
            f'<text x="{x + slot * 0.3:.1f}" y="{y(value) - 4:.1f}" text-anchor="middle">{value:,.0f}</text>',
            f'<text x="{x + slot * 0.3:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{label}</text>',
        ]
    for value, label in lines:
        parts += [(f'<line x1="{left}" y1="{y(value):.1f}" x2="{width - 20}" y2="{y(value):.1f}" stroke="#c04040" '
                  'stroke-dasharray="6 4"/>'),
                  f'<text x="{width - 22}" y="{y(value) - 5:.1f}" text-anchor="end" fill="#c04040">{label}</text>']
    parts += [f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">{x_label}</text>', "</svg>"]
    return "\n".join(parts) + "\n"


def keep_partial(out: Path, measured: dict[str, Any]) -> None:
    """A failed run keeps what it measured so far beside --out, as <stem>-partial.json."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.stem + "-partial.json")
    partial.write_text(json.dumps(measured, indent=2, default=str) + "\n")
    say(f"failed: what was measured so far is in {partial}")
