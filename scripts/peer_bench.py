"""stock-ledger side by side with Kafka Connect + the Debezium JDBC sink, on the same broker, database and movements.

What users would pick instead of us: Kafka Connect 4.1.1 standalone with the Debezium JDBC sink (both from Maven
Central, resolved by this script into ~/.cache/stock-ledger/connect-<version>/; scripts/connect/ holds the poms and
the properties templates, nothing fetched is committed). One run:

1. side by side  N movements (default 200,000, 24 partitions) drained by `stock-ledger run` (one process, from
                 spawn to every stored offset at the log end) and by Connect in insert mode, then in upsert mode
                 (from JVM start to N rows in the table). `--repeat` repeats all three and reports medians.
2. kill drill    `--drill-count` movements (default 50,000); `--kills` (default 5) SIGKILLs at random moments
                 while each system drains them (after the first rows of each incarnation landed), a restart right
                 after each kill; at the end: rows vs distinct movement ids for each system.

Input: the peer cannot read our message format (the Debezium sink needs typed records), so the same movements
(`produce.movements`, same seed) are produced a second time, to a second topic, in JsonConverter's
`{"schema": ..., "payload": ...}` envelope (`connect_envelope`), with the same keys. The peer writes into a table
with the ledger's column types (`movement_id uuid`, `occurred_at timestamptz`, ...) plus the Kafka coordinates (an
InsertField transform); it keeps no stock levels and no quarantine, so it does less work than the ledger.

Skipped with a message (exit 0) where `java` or `mvn` is missing. Not in CI: it runs for minutes.
`.venv/bin/python scripts/peer_bench.py` or `.venv/bin/python scripts/bench.py --peer connect [options]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import msgspec
import structlog
from aiokafka import AIOKafkaProducer
from benchkit import ROOT, Bench, Options, bar_svg, environment, keep_partial, median_of, run_on_uvloop, say
from localservices import discover, free_port, start_worker, wait_until

from stock_ledger.domain import Movement, parse
from stock_ledger.produce import movements
from stock_ledger.sink import stored_offsets

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    import asyncpg

KAFKA_VERSION: Final = os.environ.get("KAFKA_VERSION", "4.1.1")
DEBEZIUM: Final = "io.debezium:debezium-connector-jdbc:3.6.0.Final:tar.gz:plugin"
CONFIG: Final = ROOT / "scripts" / "connect"
CACHE: Final = Path(os.environ.get("STOCK_LEDGER_CACHE", Path.home() / ".cache" / "stock-ledger"))
HOME: Final = CACHE / f"connect-{KAFKA_VERSION}"
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


# ------------------------------------------------------------------------------------------------ artifacts


def missing_tools() -> list[str]:
    return [tool for tool in ("java", "mvn") if shutil.which(tool) is None]


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


# ------------------------------------------------------------------------------------------------ the peer


@dataclass
class Connect:
    """One Kafka Connect standalone process running one JDBC sink connector."""

    bench: Bench
    libs: Path
    plugins: Path
    topic: str
    table: str
    mode: str
    name: str
    state: Path
    popen: subprocess.Popen[bytes] | None = None
    incarnation: int = 0

    def start(self) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        url, user, password = jdbc_url(self.bench.services.admin_url, self.bench.database)
        worker = self.state / "worker.properties"
        worker.write_text(fill((CONFIG / "worker.properties").read_text(), bootstrap=self.bench.services.kafka,
                               state=str(self.state), plugins=str(self.plugins), rest_port=str(free_port())))
        sink = self.state / "sink.properties"
        upsert = self.mode == "upsert"
        sink.write_text(fill((CONFIG / "jdbc-sink.properties").read_text(), name=self.name, topic=self.topic,
                             jdbc_url=url, user=user, password=password, mode=self.mode,
                             pk_mode="record_value" if upsert else "none", pk_fields="movement_id" if upsert else "",
                             table=self.table))
        self.incarnation += 1
        log = self.state / f"connect-{self.incarnation}.log"
        java = ["java", "-Xmx512m", f"-Dlog4j2.configurationFile={CONFIG / 'log4j2.properties'}",
                "-cp", f"{self.libs}/*", "org.apache.kafka.connect.cli.ConnectStandalone", str(worker), str(sink)]
        with log.open("wb") as out:
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
            try:
                await asyncio.to_thread(self.popen.wait, 30)
            except subprocess.TimeoutExpired:
                self.kill()


async def create_table(bench: Bench, table: str, mode: str) -> None:
    conn = await bench.owner()
    try:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await conn.execute(_TABLE.format(name=table, pk=", PRIMARY KEY (movement_id)" if mode == "upsert" else ""))
    finally:
        await conn.close()


async def counts(conn: asyncpg.Connection, table: str) -> tuple[int, int]:
    row = await conn.fetchrow(f"SELECT count(*), count(DISTINCT movement_id) FROM {table}")
    assert row is not None  # noqa: S101 - an aggregate always returns one row
    return int(row[0]), int(row[1])


async def produce_envelopes(bench: Bench, topic: str, count: int, seed: int) -> float:
    """The same movements as `produce.produce(seed=seed)`, same keys, in the JsonConverter envelope."""
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


async def connect_drain(bench: Bench, peer: Connect, count: int, within: float) -> dict[str, float]:
    """Time from JVM start until the table holds `count` distinct movements."""
    await create_table(bench, peer.table, peer.mode)
    conn = await bench.owner()
    started = time.perf_counter()
    peer.start()
    first: float | None = None
    last_say = time.monotonic()
    try:
        while True:
            rows = int(await conn.fetchval(f"SELECT count(*) FROM {peer.table}"))
            now = time.perf_counter()
            if rows and first is None:
                first = now
            if rows >= count:
                break
            peer.check_alive()
            if now - started > within:
                raise RuntimeError(f"Kafka Connect ({peer.mode}) wrote {rows:,} of {count:,} rows in {within:g}s")
            if time.monotonic() - last_say > 5:
                last_say = time.monotonic()
                say(f"  connect {peer.mode}: {rows:,}/{count:,} rows, {rows / (now - started):,.0f}/s")
            await asyncio.sleep(0.2)
        rows, distinct = await counts(conn, peer.table)
    finally:
        await peer.stop()
        await conn.close()
    seconds = now - started
    steady = now - (first or started)
    say(f"  connect {peer.mode}: {count:,} in {seconds:.1f}s ({count / seconds:,.0f}/s from JVM start, "
        f"{count / steady:,.0f}/s from the first row); rows {rows:,}, distinct {distinct:,}")
    return {"seconds": seconds, "rate": count / seconds, "steady_rate": count / steady, "rows": float(rows),
            "distinct": float(distinct)}


# ------------------------------------------------------------------------------------------------ kill drills


async def _wait_progress(check: Callable[[], None], read: Callable[[], Awaitable[Any]], above: int,
                         within: float) -> None:
    async def moved() -> bool:
        return int(await read()) > above

    await wait_until(moved, within, f"no progress within {within:g}s (stuck at {above:,})", check=check, every=0.05)


async def drill_connect(bench: Bench, peer: Connect, count: int, kills: int, rng: random.Random) -> dict[str, Any]:
    await create_table(bench, peer.table, peer.mode)
    conn = await bench.owner()
    landed = 0
    try:
        peer.start()
        for _ in range(kills):
            rows = int(await conn.fetchval(f"SELECT count(*) FROM {peer.table}"))
            await _wait_progress(peer.check_alive, lambda: conn.fetchval(f"SELECT count(*) FROM {peer.table}"),
                                 rows, 180)
            await asyncio.sleep(rng.uniform(0.0, 2.0))
            if (await counts(conn, peer.table))[1] >= count:
                break
            peer.kill()
            landed += 1
            say(f"  drill connect {peer.mode}: kill -9 #{landed} at {(await counts(conn, peer.table))[1]:,} distinct")
            peer.start()
        # Drained = every movement there and no new row for 5 s (Connect has no end-of-work signal).
        stable_since, last = time.monotonic(), -1
        deadline = time.monotonic() + 600
        while True:
            rows, distinct = await counts(conn, peer.table)
            if rows != last:
                stable_since, last = time.monotonic(), rows
            if distinct >= count and time.monotonic() - stable_since > 5:
                break
            peer.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"connect drill not drained: {rows:,} rows, {distinct:,} distinct of {count:,}")
            await asyncio.sleep(0.5)
    finally:
        await peer.stop()
        await conn.close()
    say(f"  drill connect {peer.mode}: {landed} kills, rows {rows:,} | distinct {distinct:,}")
    return {"system": f"connect-{peer.mode}", "kills": landed, "rows": rows, "distinct": distinct,
            "duplicates": rows - distinct}


async def drill_ours(  # noqa: C901 - one scenario read top to bottom: spawn, kill, respawn, drain, count
    bench: Bench, topic: str, count: int, kills: int, rng: random.Random,
) -> dict[str, Any]:
    await bench.reset_ledger()
    group = f"peer-{bench.run_id}-drill"
    ends = await bench.end_offsets(topic)
    conn = await bench.owner()
    logs = bench.logs
    landed = 0
    popen: subprocess.Popen[bytes] | None = None

    def spawn(i: int) -> subprocess.Popen[bytes]:
        return start_worker(bench.worker_env(topic, group, {}), logs / f"drill-{i}.log").proc

    def check() -> None:
        if popen is not None and popen.poll() is not None:
            raise RuntimeError(f"the worker exited with {popen.returncode}; see {logs}")

    async def applied() -> int:
        stored = await stored_offsets(conn, group, topic)
        return sum(min(n or 0, ends.get(p, 0)) for p, n in stored.items())

    total = sum(ends.values())
    if total != count:
        raise RuntimeError(f"the drill topic holds {total:,} records, expected {count:,}")
    try:
        popen = spawn(0)
        for i in range(kills):
            await _wait_progress(check, applied, await applied(), 180)
            await asyncio.sleep(rng.uniform(0.0, 0.25))  # a 50k drain lasts about a second
            if await applied() >= total:
                break
            popen.kill()
            popen.wait(30)
            landed += 1
            say(f"  drill stock-ledger: kill -9 #{landed} at {await applied():,} applied")
            popen = spawn(i + 1)
        deadline = time.monotonic() + 600
        while await applied() < total:
            check()
            if time.monotonic() > deadline:
                raise RuntimeError("the worker did not drain the drill topic in 600 s")
            await asyncio.sleep(0.2)
        popen.send_signal(signal.SIGTERM)
        await asyncio.to_thread(popen.wait, 30)
        row = await conn.fetchrow("SELECT count(*), count(DISTINCT movement_id) FROM stock_movements")
        mismatches = await conn.fetchval("""
            SELECT count(*) FROM (SELECT warehouse_id, sku, sum(qty) AS total FROM stock_movements GROUP BY 1, 2) m
            FULL JOIN stock_levels l USING (warehouse_id, sku) WHERE coalesce(m.total, 0) <> coalesce(l.on_hand, 0)""")
    finally:
        if popen is not None and popen.poll() is None:
            popen.kill()
        await conn.close()
    assert row is not None  # noqa: S101 - an aggregate always returns one row
    say(f"  drill stock-ledger: {landed} kills, rows {row[0]:,} | distinct {row[1]:,}, "
        f"stock level mismatches {mismatches}")
    return {"system": "stock-ledger", "kills": landed, "rows": int(row[0]), "distinct": int(row[1]),
            "duplicates": int(row[0]) - int(row[1]), "level_mismatches": int(mismatches)}


# ------------------------------------------------------------------------------------------------ the run


@dataclass(frozen=True)
class PeerOptions:
    count: int
    drill_count: int
    kills: int
    repeat: int
    modes: list[str]
    seed: int
    skip_drill: bool
    skip_side: bool
    timeout: float
    out: Path


async def measure(o: PeerOptions) -> dict[str, Any]:
    libs, plugins = await asyncio.to_thread(resolve_artifacts)
    bench = Bench(discover(), Options.drains_only(o.count, o.repeat, o.timeout, o.out))
    say(f"run {bench.run_id}: N={o.count:,}, modes {o.modes}; logs in {bench.logs}")
    state = bench.logs / "connect"
    result: dict[str, Any] = {"runs": [], "drill": []}
    try:
        await bench.create_database()
        ours = await bench.create_topic("ours")
        theirs = await bench.create_topic("connect")
        if not o.skip_side:
            await bench.produce(ours, o.count, seed=o.seed)
            say(f"producing the same {o.count:,} movements in the JsonConverter envelope to {theirs}")
            result["envelope_produce_seconds"] = await produce_envelopes(bench, theirs, o.count, o.seed)
        for r in range(0 if o.skip_side else o.repeat):
            say(f"=== repetition {r + 1}/{o.repeat}")
            run = {f"ours_{k}": v for k, v in (await bench.worker(ours, f"peer-{r}", 1, o.count)).items()}
            for mode in o.modes:
                peer = Connect(bench, libs, plugins, theirs, f"connect_{mode}", mode, f"sl-{bench.run_id}-{mode}-{r}",
                               state / f"{mode}-{r}")
                run |= {f"connect_{mode}_{k}": v for k, v in (await connect_drain(bench, peer, o.count,
                                                                                  o.timeout)).items()}
            result["runs"].append(run)
        if not o.skip_drill:
            say(f"=== kill drill: {o.drill_count:,} movements, {o.kills} kill -9 each")
            rng = random.Random(o.seed)  # random moments, reproducible from the seed
            ours_d = await bench.create_topic("drill-ours")
            theirs_d = await bench.create_topic("drill-connect")
            await bench.produce(ours_d, o.drill_count, seed=o.seed + 1)
            await produce_envelopes(bench, theirs_d, o.drill_count, o.seed + 1)
            result["drill"].append(await drill_ours(bench, ours_d, o.drill_count, o.kills, rng))
            for mode in o.modes:
                peer = Connect(bench, libs, plugins, theirs_d, f"drill_{mode}", mode, f"sl-{bench.run_id}-drill-{mode}",
                               state / f"drill-{mode}")
                result["drill"].append(await drill_connect(bench, peer, o.drill_count, o.kills, rng))
        result["services"] = await bench.versions()
    except BaseException:
        bench.keep_logs = True
        keep_partial(o.out, result)  # a shared PostgreSQL restarted mid-drill once
        raise
    finally:
        await bench.drop_database()
        await bench.delete_topics()
        say(f"logs kept in {bench.logs}" if bench.keep_logs else f"logs in {bench.logs}")
    return result


def summarise(o: PeerOptions, measured: dict[str, Any]) -> dict[str, Any]:
    runs = measured["runs"]
    med = median_of(runs) if runs else {}
    ratios = {f"ours_vs_connect_{m}": med["ours_rate"] / med[f"connect_{m}_rate"] for m in o.modes} if runs else {}
    ratios_first_run = {f"ours_vs_connect_{m}": runs[0]["ours_rate"] / runs[0][f"connect_{m}_rate"]
                        for m in o.modes} if runs else {}
    return {"meta": environment(Options.drains_only(o.count, o.repeat, o.timeout, o.out))
            | {"peer_options": {k: str(v) for k, v in vars(o).items()}, "services": measured.get("services"),
               "connect": {"kafka_connect": KAFKA_VERSION, "sink": DEBEZIUM}},
            "runs": runs, "median": med, "ratios": ratios, "ratios_first_run": ratios_first_run,
            "drill": measured["drill"], "envelope_produce_seconds": measured.get("envelope_produce_seconds")}


def render(o: PeerOptions, s: dict[str, Any]) -> str:
    m = s["median"]
    out: list[str] = []
    if m:
        out += [(f"stock-ledger vs Kafka Connect {KAFKA_VERSION} + Debezium JDBC sink, {s['meta']['date']}: "
                 f"N={o.count:,}, median of {o.repeat}"), "",
                "system                               movements/s (process start)  (first row)  ratio",
                f"{'stock-ledger run (x1)':<37}{m['ours_rate']:>28,.0f}  {m['ours_steady_rate']:>11,.0f}"]
        out += [f"{'Connect + JDBC sink, ' + mode:<37}{m[f'connect_{mode}_rate']:>28,.0f}  "
                f"{m[f'connect_{mode}_steady_rate']:>11,.0f}  ours = {s['ratios'][f'ours_vs_connect_{mode}']:.1f} x"
                for mode in o.modes]
    if s["drill"]:
        out += ["", f"kill drill ({o.drill_count:,} movements, kill -9 at random moments, restart):",
                "system                 kills  rows | distinct  duplicates"]
        out += [f"{d['system']:<22} {d['kills']:>5}  {d['rows']:,} | {d['distinct']:,}  {d['duplicates']:>10,}"
                for d in s["drill"]]
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None = None) -> PeerOptions:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--count", type=int, default=200_000, help="movements for the side-by-side run")
    p.add_argument("--drill-count", type=int, default=50_000, help="movements for the kill drill")
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs during each drill")
    p.add_argument("--repeat", type=int, default=1, help="repeat the side-by-side run, report medians")
    p.add_argument("--modes", default="insert,upsert", help="Debezium insert.mode values to run")
    p.add_argument("--seed", type=int, default=21, help="seed of the movements and of the kill moments")
    p.add_argument("--skip-drill", action="store_true", help="only the side-by-side run")
    p.add_argument("--skip-side", action="store_true", help="only the kill drill")
    p.add_argument("--timeout", type=float, default=900.0, help="give up on a drain after this many seconds")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default bench-results/peer-<date>.json)")
    a = p.parse_args(argv)
    modes = [x.strip() for x in a.modes.split(",") if x.strip()]
    if a.count < 1 or a.drill_count < 1 or a.kills < 0 or a.repeat < 1 or not set(modes) <= {"insert", "upsert"}:
        p.error("--count, --drill-count, --repeat >= 1, --kills >= 0, --modes from insert,upsert")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = a.out or ROOT / "bench-results" / f"peer-{stamp}.json"
    return PeerOptions(a.count, a.drill_count, a.kills, a.repeat, modes, a.seed, a.skip_drill, a.skip_side, a.timeout,
                       out)


async def main(o: PeerOptions) -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    missing = missing_tools()
    if missing:
        print(f"peer bench skipped: {' and '.join(missing)} not found. Kafka Connect needs Java 17+ and Maven to "
              "resolve it from Maven Central (Debian: apt-get install -y openjdk-17-jre-headless maven).")
        return 0
    summary = summarise(o, await measure(o))
    o.out.parent.mkdir(parents=True, exist_ok=True)
    o.out.write_text(json.dumps(summary, indent=2) + "\n")
    m = summary["median"]
    if m:
        o.out.with_suffix(".svg").write_text(bar_svg(
            f"{o.count:,} movements, from process start (movements/s)",
            [("stock-ledger", m["ours_rate"]), *((f"Connect {mode}", m[f"connect_{mode}_rate"]) for mode in o.modes)],
            "same broker, same PostgreSQL, same movements"))
    print(render(o, summary))
    say(f"results written to {o.out}")
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    return run_on_uvloop(main(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(run())
