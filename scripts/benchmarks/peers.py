"""peers: the worker against its limits, Kafka Connect + the Debezium JDBC sink and the naive loop, on the same rows.

The peer is Kafka Connect (scripts/kafka.sh's version) standalone with the Debezium JDBC sink, resolved from Maven
Central into ~/.cache/stock-ledger/connect-<version>/ on the first run (scripts/connect/: the poms, the templates).
One broker, one database, one set of movements:

1. side by side  N movements (24 partitions): raw consume and raw COPY (the limits, as `drain` measures them),
                 `stock-ledger run` (one process, spawn to every stored offset at the log end), Connect in insert
                 and in upsert mode (JVM start to N rows in the table), and the naive loop on a slice; --repeat:
                 medians. The README's headline table.
2. kill drill    --kills SIGKILLs at random moments while each system drains --drill-count movements (after the
                 first rows of each incarnation landed), each followed by a restart; then rows vs distinct ids.

The Debezium sink needs typed records, so the same movements (same seed, same keys) go to a second topic in
JsonConverter's {"schema", "payload"} envelope (`connect_envelope`). The peer's table has the ledger's column types
plus the Kafka coordinates (an InsertField transform) and no levels or quarantine: less work than the ledger.
Skipped with a message (exit 0) where `java` or `mvn` is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import string
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import msgspec
from aiokafka import AIOKafkaProducer
from benchkit import (
    CACHE,
    KAFKA_VERSION,
    LEVEL_MISMATCHES,
    ROOT,
    Bench,
    applied,
    bar_svg,
    check_alive,
    median_of,
    prefixed,
    say,
    table,
    timed_until,
)
from localservices import WorkerProcess, free_port, start_worker, stop_workers, wait_until

from benchmarks.drain import NAIVE_COUNT, limits, naive
from stock_ledger.domain import Movement, parse
from stock_ledger.produce import movements

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    import asyncpg

DEBEZIUM: Final = "io.debezium:debezium-connector-jdbc:3.6.0.Final:tar.gz:plugin"
CONFIG: Final = ROOT / "scripts" / "connect"
HOME: Final = CACHE / f"connect-{KAFKA_VERSION}"
MODES: Final = ("insert", "upsert")
SEED: Final = 21
# Debezium's logical names give the columns their types: uuid and timestamptz, like stock_movements.
ENVELOPE_SCHEMA: Final = {
    "type": "struct", "name": "warehouse.movement", "optional": False,
    "fields": [
        {"field": "movement_id", "type": "string", "optional": False, "name": "io.debezium.data.Uuid"},
        {"field": "warehouse_id", "type": "string", "optional": False},
        {"field": "sku", "type": "string", "optional": False},
        {"field": "qty", "type": "int64", "optional": False},
        {"field": "kind", "type": "string", "optional": False},
        {"field": "occurred_at", "type": "string", "optional": False, "name": "io.debezium.time.ZonedTimestamp"},
    ],
}
_TABLE: Final = """
CREATE TABLE {name} (
    movement_id uuid NOT NULL, warehouse_id text NOT NULL, sku text NOT NULL, qty bigint NOT NULL,
    kind text NOT NULL, occurred_at timestamptz NOT NULL,
    kafka_topic text, kafka_partition integer, kafka_offset bigint{pk})
"""


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    p = add("peers", __doc__, measure)
    p.add_argument("--count", type=int, default=200_000, help="movements for the side-by-side run (default 200,000)")
    p.add_argument("--repeat", type=int, default=1, help="repeat the side-by-side run, report medians")
    p.add_argument("--drill-count", type=int, default=50_000, help="movements for the kill drill (default 50,000)")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs during each drill (default 5)")
    p.add_argument("--skip-drill", action="store_true", help="only the side-by-side run")


def connect_envelope(m: Movement) -> bytes:
    """One movement as JsonConverter (schemas.enable=true) expects it: the schema travels with every record."""
    payload = {"movement_id": str(m.movement_id), "warehouse_id": m.warehouse_id, "sku": m.sku, "qty": m.qty,
               "kind": m.kind, "occurred_at": m.occurred_at.isoformat()}
    return msgspec.json.encode({"schema": ENVELOPE_SCHEMA, "payload": payload})


def fill(template: str, **values: str) -> str:
    """A properties template of scripts/connect/ with its ${...} placeholders filled (all must be given)."""
    return string.Template(template).substitute(values)


def jdbc_url(postgres_url: str, database: str) -> tuple[str, str, str]:
    """(JDBC URL, user, password) for `database` on the server of a postgresql:// URL."""
    parts = urlsplit(postgres_url)
    host = parts.hostname or "127.0.0.1"
    return f"jdbc:postgresql://{host}:{parts.port or 5432}/{database}", parts.username or "", parts.password or ""


def _mvn(*args: str) -> None:
    command = ["mvn", "-B", "-q", "-Dstyle.color=never", "-s", str(CONFIG / "settings.xml"), *args]
    done = subprocess.run(command, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=1800,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"Maven failed ({' '.join(command)}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}\n"
                           "Check that Maven Central is reachable (https://repo.maven.apache.org/maven2).")


def resolve_artifacts() -> tuple[Path, Path]:
    """The Connect worker's classpath and the plugin directory, from Maven Central into the cache (once)."""
    libs, plugins = HOME / "libs", HOME / "plugins"
    if not any(libs.glob("connect-runtime-*.jar")):
        say(f"resolving Kafka Connect {KAFKA_VERSION} from Maven Central into {libs} (once, a few minutes)")
        libs.mkdir(parents=True, exist_ok=True)
        _mvn("-f", str(CONFIG / "pom.xml"), f"-Dkafka.version={KAFKA_VERSION}", "dependency:copy-dependencies",
             "-DincludeScope=runtime", f"-DoutputDirectory={libs}")
    if not (plugins / "debezium-connector-jdbc").is_dir():
        say(f"resolving {DEBEZIUM} from Maven Central into {plugins}")
        plugins.mkdir(parents=True, exist_ok=True)
        _mvn("dependency:copy", f"-Dartifact={DEBEZIUM}", f"-DoutputDirectory={plugins}")
        for archive in plugins.glob("debezium-connector-jdbc-*.tar.gz"):
            subprocess.run(["tar", "-xzf", str(archive), "-C", str(plugins)], check=True, timeout=300)
    return libs, plugins


@dataclass
class Connect:
    """One Kafka Connect standalone process running one JDBC sink connector into `table`."""

    bench: Bench
    classpath: tuple[Path, Path]
    topic: str
    mode: str
    label: str
    popen: subprocess.Popen[bytes] | None = None
    incarnation: int = 0

    @property
    def table(self) -> str:
        return f"connect_{self.label}".replace("-", "_")

    @property
    def state(self) -> Path:
        return self.bench.logs / "connect" / self.label

    async def create_table(self) -> None:
        async with self.bench.owner() as conn:
            await conn.execute(_TABLE.format(name=self.table, pk=", PRIMARY KEY (movement_id)"
                                             if self.mode == "upsert" else ""))

    def start(self) -> None:
        libs, plugins = self.classpath
        self.state.mkdir(parents=True, exist_ok=True)
        url, user, password = jdbc_url(self.bench.services.admin_url, self.bench.database)
        worker, sink = self.state / "worker.properties", self.state / "sink.properties"
        worker.write_text(fill((CONFIG / "worker.properties").read_text(), bootstrap=self.bench.services.kafka,
                               state=str(self.state), plugins=str(plugins), rest_port=str(free_port())))
        upsert = self.mode == "upsert"
        sink.write_text(fill((CONFIG / "jdbc-sink.properties").read_text(), name=f"sl-{self.bench.run_id}-{self.label}",
                             topic=self.topic, jdbc_url=url, user=user, password=password, mode=self.mode,
                             pk_mode="record_value" if upsert else "none", pk_fields="movement_id" if upsert else "",
                             table=self.table))
        self.incarnation += 1
        java = ["java", "-Xmx512m", f"-Dlog4j2.configurationFile={CONFIG / 'log4j2.properties'}",
                "-cp", f"{libs}/*", "org.apache.kafka.connect.cli.ConnectStandalone", str(worker), str(sink)]
        with (self.state / f"connect-{self.incarnation}.log").open("wb") as out:
            self.popen = subprocess.Popen(java, stdout=out, stderr=subprocess.STDOUT)

    def check_alive(self) -> None:
        if self.popen is not None and self.popen.poll() is not None:
            log = self.state / f"connect-{self.incarnation}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"Kafka Connect exited with {self.popen.returncode}; its log ({log}) ends:\n{tail}")

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(30)

    async def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.popen.wait, 30)
            self.kill()

    async def rows(self, conn: asyncpg.Connection) -> int:
        return int(await conn.fetchval(f"SELECT count(*) FROM {self.table}"))

    async def drain(self, count: int) -> dict[str, float]:
        """Time from JVM start until the table holds `count` rows."""
        await self.create_table()
        async with self.bench.owner() as conn:
            started = time.perf_counter()
            self.start()
            try:
                first, done = await timed_until(lambda: self.rows(conn), count, self.bench.timeout,
                                                f"connect {self.mode}", self.check_alive)
            finally:
                await self.stop()
            n, distinct = await counts(conn, self.table)
        seconds, steady = done - started, done - first
        say(f"  connect {self.mode}: {count:,} in {seconds:.1f}s ({count / seconds:,.0f}/s from JVM start, "
            f"{count / steady:,.0f}/s from the first row); rows {n:,}, distinct {distinct:,}")
        return {"seconds": seconds, "rate": count / seconds, "steady_rate": count / steady, "rows": float(n),
                "distinct": float(distinct)}


async def counts(conn: asyncpg.Connection, table: str) -> tuple[int, int]:
    [(rows, distinct)] = await conn.fetch(f"SELECT count(*), count(DISTINCT movement_id) FROM {table}")
    return int(rows), int(distinct)


async def produce_envelopes(bench: Bench, topic: str, count: int, seed: int) -> float:
    """The same movements as `produce.produce(seed=seed)`, same keys, in the JsonConverter envelope."""
    say(f"producing the same {count:,} movements in the JsonConverter envelope to {topic}")
    producer = AIOKafkaProducer(bootstrap_servers=bench.services.kafka, enable_idempotence=True, acks="all",
                                linger_ms=5, max_batch_size=512 * 1024)
    await producer.start()
    started = time.perf_counter()
    try:
        pending: list[asyncio.Future[object]] = []
        for key, value in movements(count, seed=seed):
            m = parse(key, value)
            if not isinstance(m, Movement):
                raise TypeError(f"the generator produced an invalid movement: {m}")
            pending.append(await producer.send(topic, value=connect_envelope(m), key=key))
            if len(pending) >= 2000:
                await asyncio.gather(*pending)
                pending.clear()
        await producer.flush()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return time.perf_counter() - started


async def kill_drill(  # noqa: PLR0913, PLR0917 - one drill, told apart by what it kills and how it counts
    kills: int, pause: float, rng: random.Random, check: Callable[[], None], progress: Callable[[], Awaitable[int]],
    done: Callable[[], Awaitable[bool]], restart: Callable[[], None],
) -> int:
    """Kill -9 and restart a system `kills` times, each at a random moment after its incarnation made progress,
    then wait until `done`; the kills that landed before it finished."""
    landed = 0
    for _ in range(kills):
        above = await progress()

        async def moved(above: int = above) -> bool:
            return await progress() > above

        await wait_until(moved, 180, f"no progress within 180s (stuck at {above:,})", check=check, every=0.05)
        await asyncio.sleep(rng.uniform(0.0, pause))
        if await done():
            break
        restart()
        landed += 1
        say(f"  drill: kill -9 #{landed} at {await progress():,}")
    await wait_until(done, 600, "not drained within 600s after the kills", check=check, every=0.5)
    return landed


async def drill_ours(bench: Bench, topic: str, count: int, kills: int, rng: random.Random) -> dict[str, Any]:
    await bench.reset_ledger()
    group, ends = f"bench-{bench.run_id}-drill", await bench.end_offsets(topic)
    workers: list[WorkerProcess] = []

    def restart() -> None:
        if workers:
            workers[-1].kill()
        workers.append(start_worker(bench.worker_env(topic, group), bench.logs / f"drill-{len(workers)}.log"))

    async with bench.owner() as conn:
        async def progress() -> int:
            return await applied(conn, group, topic, ends)

        async def drained() -> bool:
            return await progress() >= count

        restart()
        try:  # a 50k drain takes about 1 s: kills within 0.25 s of progress
            landed = await kill_drill(kills, 0.25, rng, lambda: check_alive(workers[-1:]), progress, drained, restart)
        finally:
            await stop_workers(workers[-1:], 30)
        rows, distinct = await counts(conn, "stock_movements")
        mismatches = await conn.fetchval(LEVEL_MISMATCHES)
    say(f"  drill stock-ledger: {landed} kills, rows {rows:,} | distinct {distinct:,}, level mismatches {mismatches}")
    return {"system": "stock-ledger", "kills": landed, "rows": rows, "distinct": distinct,
            "duplicates": rows - distinct, "level_mismatches": int(mismatches)}


async def drill_connect(peer: Connect, count: int, kills: int, rng: random.Random) -> dict[str, Any]:
    await peer.create_table()
    stable = {"rows": -1, "since": time.monotonic()}
    async with peer.bench.owner() as conn:
        async def drained() -> bool:  # every movement there and no new row for 5 s: Connect has no end of work
            n, distinct = await counts(conn, peer.table)
            if n != stable["rows"]:
                stable.update(rows=n, since=time.monotonic())
            return distinct >= count and time.monotonic() - stable["since"] > 5

        def restart() -> None:
            peer.kill()
            peer.start()

        peer.start()
        try:
            landed = await kill_drill(kills, 2.0, rng, peer.check_alive, lambda: peer.rows(conn), drained, restart)
        finally:
            await peer.stop()
        n, distinct = await counts(conn, peer.table)
    say(f"  drill connect {peer.mode}: {landed} kills, rows {n:,} | distinct {distinct:,}")
    return {"system": f"connect-{peer.mode}", "kills": landed, "rows": n, "distinct": distinct,
            "duplicates": n - distinct}


async def measure(bench: Bench, a: argparse.Namespace) -> str:
    missing = [tool for tool in ("java", "mvn") if shutil.which(tool) is None]
    if missing:
        return (f"peers skipped: {' and '.join(missing)} not found. Kafka Connect needs Java 17+ and Maven to "
                "resolve it from Maven Central (Debian: apt-get install -y openjdk-17-jre-headless maven).")
    classpath = await asyncio.to_thread(resolve_artifacts)
    res = bench.results
    res["meta"]["connect"] = {"kafka_connect": KAFKA_VERSION, "sink": DEBEZIUM}
    await bench.create_database()
    ours, theirs = await bench.create_topic("ours"), await bench.create_topic("connect")
    res["produce"] = await bench.produce(ours, a.count, seed=SEED)
    res["envelope_produce_seconds"] = await produce_envelopes(bench, theirs, a.count, SEED)
    res["runs"] = runs = []
    for r in range(a.repeat):
        say(f"=== repetition {r + 1}/{a.repeat}")
        run = await limits(bench, ours)
        run |= prefixed("ours_", await bench.worker(ours, f"peer-{r}", 1, a.count))
        for mode in MODES:
            peer = Connect(bench, classpath, theirs, mode, f"{mode}-{r}")
            run |= prefixed(f"connect_{mode}_", await peer.drain(a.count))
        run |= await naive(bench, ours, min(NAIVE_COUNT, a.count))
        runs.append(run)
    m = res["median"] = median_of(runs)
    limit = min(m["raw_consume_rate"], m["raw_copy_rate"])
    res["ratios"] = {"ours_vs_limit": m["ours_rate"] / limit, "ours_vs_naive": m["ours_rate"] / m["naive_rate"],
                     **{f"ours_vs_connect_{x}": m["ours_rate"] / m[f"connect_{x}_rate"] for x in MODES}}
    res["drill"] = []
    if not a.skip_drill:
        say(f"=== kill drill: {a.drill_count:,} movements, {a.kills} kill -9 each")
        rng = random.Random(SEED)  # random moments, reproducible from the seed
        ours_d, theirs_d = await bench.create_topic("drill-ours"), await bench.create_topic("drill-connect")
        await bench.produce(ours_d, a.drill_count, seed=SEED + 1)
        await produce_envelopes(bench, theirs_d, a.drill_count, SEED + 1)
        res["drill"].append(await drill_ours(bench, ours_d, a.drill_count, a.kills, rng))
        for mode in MODES:
            peer = Connect(bench, classpath, theirs_d, mode, f"drill-{mode}")
            res["drill"].append(await drill_connect(peer, a.drill_count, a.kills, rng))
    bench.charts[".svg"] = bar_svg(
        f"{a.count:,} movements, from process start (movements/s)",
        [("stock-ledger", m["ours_rate"]), *((f"Connect {x}", m[f"connect_{x}_rate"]) for x in MODES),
         ("naive", m["naive_rate"])], "same broker, same PostgreSQL, same movements",
        [(limit, "min(raw consume, raw COPY)")])
    return render(a, res, limit)


def render(a: argparse.Namespace, res: dict[str, Any], limit: float) -> str:
    m, r = res["median"], res["ratios"]
    rows = [("physical limit: raw consume (no DB)", m["raw_consume_rate"], "", ""),
            ("physical limit: raw COPY (no Kafka)", m["raw_copy_rate"], "", ""),
            ("stock-ledger run (x1)", m["ours_rate"], m["ours_steady_rate"], f"{r['ours_vs_limit']:.2f} x limit"),
            *((f"Kafka Connect + JDBC sink, {x} mode", m[f"connect_{x}_rate"], m[f"connect_{x}_steady_rate"],
               f"stock-ledger = {r[f'ours_vs_connect_{x}']:.1f} x") for x in MODES),
            (f"naive loop ({min(NAIVE_COUNT, a.count):,}; INSERT per record)", m["naive_rate"], "",
             f"stock-ledger = {r['ours_vs_naive']:.1f} x")]
    out = [(f"stock-ledger vs its limits (min {limit:,.0f}/s), Kafka Connect {KAFKA_VERSION} + Debezium JDBC sink "
            f"and the naive loop: N={a.count:,}, median of {a.repeat}"), "",
           table(("system", "movements/s (process start)", "(first row)", "ratio"),
                 ((n, f"{v:,.0f}", f"{s:,.0f}" if s else "", x) for n, v, s, x in rows))]
    if res["drill"]:
        out += ["", f"kill drill ({a.drill_count:,} movements, kill -9 at random moments, restart):",
                table(("system", "kills", "rows", "distinct", "duplicates"), ((
                    d["system"], d["kills"], f"{d['rows']:,}", f"{d['distinct']:,}", f"{d['duplicates']:,}")
                    for d in res["drill"]))]
    return "\n".join(out)
