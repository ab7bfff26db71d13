"""peers: the worker against its limits, Kafka Connect with the Debezium JDBC sink (insert and upsert mode) and the
naive loop, on the same N movements (medians of --repeat; the README's headline), then a kill drill: --kills
SIGKILLs at random moments while each drains --drill-count movements, a restart after each; rows against distinct
ids. Connect is resolved from Maven Central on the first run (scripts/connect/); skipped without `java` or `mvn`.
How and why: docs/performance.md, "Beside Kafka Connect".
"""

import argparse
import asyncio
import itertools
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import asyncpg
import msgspec
from scripts import benchkit as kit
from scripts.benchmarks.drain import NAIVE_COUNT, limits, naive
from tests.support.registry import send_with_headers
from tests.support.services import WorkerProcess, free_port, start_worker, stop_workers, wait_until

from stock_ledger.domain import Movement, parse
from stock_ledger.produce import movements

DEBEZIUM: Final = "io.debezium:debezium-connector-jdbc:3.6.0.Final:tar.gz:plugin"
CONFIG: Final = kit.ROOT / "scripts" / "connect"
HOME: Final = kit.CACHE / f"connect-{kit.KAFKA_VERSION}"
MODES: Final = ("insert", "upsert")
SEED: Final = 21
RNG: Final = random.Random(SEED)  # the drill's kill moments: one run per process, reproducible from the seed
# Debezium's logical names give the columns their types: uuid and timestamptz, like stock_movements.
ENVELOPE_SCHEMA: Final = {"type": "struct", "name": "warehouse.movement", "optional": False, "fields": [
    {"field": f, "type": t, "optional": False, **({"name": name} if name else {})} for f, t, name in (
        ("movement_id", "string", "io.debezium.data.Uuid"), ("warehouse_id", "string", None),
        ("sku", "string", None), ("qty", "int64", None), ("kind", "string", None),
        ("occurred_at", "string", "io.debezium.time.ZonedTimestamp"))]}
_TABLE: Final = """CREATE TABLE {name} (movement_id uuid NOT NULL, warehouse_id text NOT NULL, sku text NOT NULL,
    qty bigint NOT NULL, kind text NOT NULL, occurred_at timestamptz NOT NULL, kafka_topic text,
    kafka_partition integer, kafka_offset bigint{pk})"""


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
    u = urlsplit(postgres_url)
    url = f"jdbc:postgresql://{u.hostname or '127.0.0.1'}:{u.port or 5432}/{database}"
    return url, u.username or "", u.password or ""


def resolve_artifacts() -> tuple[Path, Path]:
    """The Connect worker's classpath and the plugin directory, from Maven Central into the cache (once)."""
    def mvn(*args: str) -> None:  # quiet: only its errors, on stderr (a failure: is Maven Central reachable?)
        subprocess.run(["mvn", "-B", "-q", "-Dstyle.color=never", "-s", str(CONFIG / "settings.xml"), *args],
                       cwd=tempfile.gettempdir(), stdout=sys.stderr, timeout=1800, check=True)

    libs, plugins = HOME / "libs", HOME / "plugins"
    if not any(libs.glob("connect-runtime-*.jar")):
        kit.say(f"resolving Kafka Connect {kit.KAFKA_VERSION} from Maven Central into {libs} (once, a few minutes)")
        mvn("-f", str(CONFIG / "pom.xml"), f"-Dkafka.version={kit.KAFKA_VERSION}", "dependency:copy-dependencies",
            "-DincludeScope=runtime", f"-DoutputDirectory={libs}")
    if not (plugins / "debezium-connector-jdbc").is_dir():
        kit.say(f"resolving {DEBEZIUM} from Maven Central into {plugins}")
        mvn("dependency:copy", f"-Dartifact={DEBEZIUM}", f"-DoutputDirectory={plugins}")
        for archive in plugins.glob("debezium-connector-jdbc-*.tar.gz"):
            subprocess.run(["tar", "-xzf", str(archive), "-C", str(plugins)], check=True, timeout=300)
    return libs, plugins


@dataclass
class Connect:
    """Kafka Connect standalone running one JDBC sink connector into its own table, one process per `start`."""

    bench: kit.Bench
    classpath: tuple[Path, Path]
    topic: str
    mode: str
    label: str
    incarnation: int = 0

    def __post_init__(self) -> None:
        self.table, self.state = f"connect_{self.label}".replace("-", "_"), self.bench.logs / "connect" / self.label

    async def create_table(self) -> None:
        async with self.bench.owner() as conn:
            await conn.execute(_TABLE.format(name=self.table, pk=", PRIMARY KEY (movement_id)"
                                             if self.mode == "upsert" else ""))

    def start(self) -> WorkerProcess:
        (libs, plugins), upsert, port = self.classpath, self.mode == "upsert", free_port()
        self.state.mkdir(parents=True, exist_ok=True)
        url, user, password = jdbc_url(self.bench.services.admin_url, self.bench.database)
        worker, sink = self.state / "worker.properties", self.state / "sink.properties"
        worker.write_text(fill((CONFIG / "worker.properties").read_text(), bootstrap=self.bench.services.kafka,
                               state=str(self.state), plugins=str(plugins), rest_port=str(port)))
        sink.write_text(fill((CONFIG / "jdbc-sink.properties").read_text(), name=f"sl-{self.bench.run_id}-{self.label}",
                             topic=self.topic, jdbc_url=url, user=user, password=password, mode=self.mode,
                             pk_mode="record_value" if upsert else "none", pk_fields="movement_id" if upsert else "",
                             table=self.table))
        self.incarnation += 1
        java = ["java", "-Xmx512m", f"-Dlog4j2.configurationFile={CONFIG / 'log4j2.properties'}",
                "-cp", f"{libs}/*", "org.apache.kafka.connect.cli.ConnectStandalone", str(worker), str(sink)]
        log = self.state / f"connect-{self.incarnation}.log"
        with log.open("wb") as out:
            return WorkerProcess(subprocess.Popen(java, stdout=out, stderr=subprocess.STDOUT), port, log, {})

    async def drain(self, count: int) -> dict[str, float]:
        """Time from JVM start until the table holds `count` rows."""
        await self.create_table()
        async with self.bench.owner() as conn:
            started, jvm = time.perf_counter(), self.start()
            try:
                first, done = await kit.timed_until(lambda: rows(conn, self.table), count, kit.DRAIN_SECONDS,
                                                    f"connect {self.mode}", lambda: kit.check_alive([jvm]))
            finally:
                await stop_workers([jvm], 30)
            n, distinct = await counts(conn, self.table)
        seconds, steady = done - started, done - first
        kit.say(f"  connect {self.mode}: {count / seconds:,.0f}/s from JVM start, rows {n:,}, distinct {distinct:,}")
        return {"seconds": seconds, "rate": count / seconds, "steady_rate": count / steady, "rows": float(n),
                "distinct": float(distinct)}


async def rows(conn: asyncpg.Connection, table: str) -> int:
    return int(await conn.fetchval(f"SELECT count(*) FROM {table}"))


async def counts(conn: asyncpg.Connection, table: str) -> tuple[int, int]:
    [(n, distinct)] = await conn.fetch(f"SELECT count(*), count(DISTINCT movement_id) FROM {table}")
    return int(n), int(distinct)


async def produce_envelopes(bench: kit.Bench, topic: str, count: int, seed: int) -> None:
    """The same movements as `produce.produce(seed=seed)`, same keys, in the JsonConverter envelope."""
    kit.say(f"producing the same {count:,} movements in the JsonConverter envelope to {topic}")
    await send_with_headers(bench.services.kafka, topic, [
        (key, connect_envelope(parse(key, value)), []) for key, value in movements(count, seed=seed)])


async def drill(bench: kit.Bench, name: str, table: str, start: Callable[[], WorkerProcess],  # noqa: PLR0913, PLR0917
                count: int, kills: int, pause: float) -> dict[str, Any]:
    """Kill -9 and `start` again a system writing into `table` `kills` times, each at a random moment (within `pause`
    s) after its incarnation wrote rows, until every movement is in and no row came for 5 s (Connect never ends)."""
    ours, stable, landed = table == "stock_movements", {"rows": -1, "since": time.monotonic()}, 0
    async with bench.owner() as conn:
        async def settled() -> bool:
            n, distinct = await counts(conn, table)
            if n != stable["rows"]:
                stable.update(rows=n, since=time.monotonic())
            return distinct >= count and time.monotonic() - stable["since"] > 5

        current = [start()]
        try:
            for _ in range(kills):
                above = await rows(conn, table)

                async def moved(above: int = above) -> bool:
                    return await rows(conn, table) > above

                await wait_until(moved, 180, f"no progress within 180s (stuck at {above:,})",
                                 check=lambda: kit.check_alive(current), every=0.05)
                await asyncio.sleep(RNG.uniform(0.0, pause))
                # Ours is done once every movement is in; Connect only once nothing more comes (its replays).
                if (await counts(conn, table))[1] >= count and (ours or await settled()):
                    break
                current[0].kill()
                current[0], landed = start(), landed + 1
                kit.say(f"  drill {name}: kill -9 #{landed} at {await rows(conn, table):,} rows")
            await wait_until(settled, 600, "not drained within 600s after the kills",
                             check=lambda: kit.check_alive(current), every=0.5)
        finally:
            await stop_workers(current, 30)
        n, distinct = await counts(conn, table)
        ledger = {"level_mismatches": int(await conn.fetchval(kit.MISMATCH_COUNT))} if ours else {}
    kit.say(f"  drill {name}: {landed} kills, rows {n:,} | distinct {distinct:,} {ledger}")
    return {"system": name, "kills": landed, "rows": n, "distinct": distinct, "duplicates": n - distinct, **ledger}


async def measure(bench: kit.Bench, a: argparse.Namespace) -> str:
    if missing := [tool for tool in ("java", "mvn") if shutil.which(tool) is None]:
        return f"peers skipped: {' and '.join(missing)} not found (Connect needs Java 17+, Maven resolves it)"
    classpath, res = await asyncio.to_thread(resolve_artifacts), bench.results
    res["meta"]["connect"] = {"kafka_connect": kit.KAFKA_VERSION, "sink": DEBEZIUM}
    await bench.create_database()
    ours, theirs = await bench.create_topic("ours"), await bench.create_topic("connect")
    res["produce"] = await bench.produce(ours, a.count, seed=SEED)
    await produce_envelopes(bench, theirs, a.count, SEED)
    res["runs"] = runs = []
    for r in range(a.repeat):
        kit.say(f"=== repetition {r + 1}/{a.repeat}")
        run = await limits(bench, ours)
        run |= kit.prefixed("ours_", (await bench.worker(ours, f"peer-{r}")).result)
        for mode in MODES:
            run |= kit.prefixed(f"connect_{mode}_", await Connect(bench, classpath, theirs, mode, f"{mode}-{r}").drain(
                a.count))
        runs.append(run | await naive(bench, ours, min(NAIVE_COUNT, a.count)))
    m = res["median"] = kit.median_of(runs)
    limit = min(m["raw_consume_rate"], m["raw_copy_rate"])
    res["ratios"] = {"ours_vs_limit": m["ours_rate"] / limit, "ours_vs_naive": m["ours_rate"] / m["naive_rate"],
                     **{f"ours_vs_connect_{x}": m["ours_rate"] / m[f"connect_{x}_rate"] for x in MODES}}
    res["drill"] = []
    if not a.skip_drill:
        kit.say(f"=== kill drill: {a.drill_count:,} movements, {a.kills} kill -9 each")
        ours_d, theirs_d = await bench.create_topic("drill-ours"), await bench.create_topic("drill-connect")
        await bench.produce(ours_d, a.drill_count, seed=SEED + 1)
        await produce_envelopes(bench, theirs_d, a.drill_count, SEED + 1)
        await bench.reset_ledger()
        spawned = itertools.count(1)
        # A 50k drain takes our worker about 1 s and Connect about 20: kills within 0.25 s and 2 s of progress.
        res["drill"].append(await drill(bench, "stock-ledger", "stock_movements", lambda: start_worker(
            bench.worker_env(ours_d, f"bench-{bench.run_id}-drill"), bench.logs / f"drill-{next(spawned)}.log"),
            a.drill_count, a.kills, 0.25))
        for mode in MODES:
            await (peer := Connect(bench, classpath, theirs_d, mode, f"drill-{mode}")).create_table()
            res["drill"].append(await drill(bench, f"connect-{mode}", peer.table, peer.start, a.drill_count, a.kills,
                                            2.0))
    bench.charts[".svg"] = kit.bar_svg(
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
    out = [(f"stock-ledger vs its limits (min {limit:,.0f}/s), Kafka Connect {kit.KAFKA_VERSION} + Debezium JDBC "
            f"sink and the naive loop: N={a.count:,}, median of {a.repeat}"), "",
           kit.table(("system", "movements/s (process start)", "(first row)", "ratio"),
                     ((n, f"{v:,.0f}", f"{s:,.0f}" if s else "", x) for n, v, s, x in rows))]
    if res["drill"]:
        out += ["", f"kill drill ({a.drill_count:,} movements, kill -9 at random moments, restart):",
                kit.table(("system", "kills", "rows", "distinct", "duplicates"), ((
                    d["system"], d["kills"], f"{d['rows']:,}", f"{d['distinct']:,}", f"{d['duplicates']:,}")
                    for d in res["drill"]))]
    return "\n".join(out)
