"""The local services harness the tests and the benches share: the project's own Kafka and PostgreSQL (started by
scripts/kafka.sh and scripts/postgres.sh), the worker's least-privileged role, URLs, scratch databases and topics,
worker processes, free ports, and the load generator pointed at a broker and topic. The tests keep their own,
independent check of the ledger (helpers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from stock_ledger import produce as load
from stock_ledger.config import load_settings
from stock_ledger.migrate import find_migrations_dir, migrate

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

ROOT = Path(__file__).resolve().parents[2]
WORKER_ROLE = "stock_ledger_worker"
WORKER_PASSWORD = os.environ.get("STOCK_LEDGER_WORKER_PASSWORD", "stock_ledger_worker")


def script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run scripts/<name> for the local services (never for endpoints configured by the environment)."""
    env = {k: v for k, v in os.environ.items() if k not in {"KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL"}}
    return subprocess.run(["bash", str(ROOT / "scripts" / name), *args], check=False, capture_output=True,
                          text=True, timeout=600, env=env)


def script_output(name: str, *args: str) -> str:
    """scripts/<name>'s stdout, stripped; a failure raises with its output."""
    done = script(name, *args)
    done.check_returncode()
    return done.stdout.strip()


def local_kafka() -> str:
    """The bootstrap address of scripts/kafka.sh's broker (KAFKA_PORT: a second broker of one's own)."""
    return f"127.0.0.1:{os.environ.get('KAFKA_PORT', '9092')}"


def url_for(admin_url: str, database: str, user: str | None = None, password: str | None = None) -> str:
    """`admin_url` pointed at another database, optionally as another user."""
    parts = urlsplit(admin_url)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}:{password}@{netloc.rsplit('@', 1)[-1]}"
    return urlunsplit((parts.scheme, netloc, f"/{database}", parts.query, parts.fragment))


@dataclass(frozen=True)
class Services:
    """Where the benches run: a bootstrap address and a URL that may CREATE DATABASE."""

    kafka: str
    admin_url: str
    origin: str  # "environment" or "scripts"
    worker_password: str = WORKER_PASSWORD

    def url_for(self, database: str, *, worker: bool = False) -> str:
        """The database's URL as its owner, or as the workers' role."""
        if worker:
            return url_for(self.admin_url, database, WORKER_ROLE, self.worker_password)
        return url_for(self.admin_url, database)


def discover() -> Services:
    """The tests' discovery without containers: KAFKA_BOOTSTRAP_SERVERS and DATABASE_URL where set, the rest
    started by the project's scripts."""
    kafka, db = os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), os.environ.get("DATABASE_URL")
    if kafka and db:
        return Services(kafka, db, "environment")
    if not kafka:
        script_output("kafka.sh", "start")
    if not db:
        script_output("postgres.sh", "start")
    return Services(kafka or local_kafka(), db or script_output("postgres.sh", "url"), "scripts")


async def ensure_login_role(admin_url: str, role: str, password: str, member_of: str) -> str:
    """`role` as a LOGIN role with `password`, a member of the NOLOGIN role `member_of` (created if missing: the
    migrations grant it its privileges). Idempotent, and safe when several processes create it at once."""
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f"""
            DO $$ BEGIN
              IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{member_of}') THEN
                CREATE ROLE {member_of} NOLOGIN; END IF;
              IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN CREATE ROLE {role} LOGIN; END IF;
            EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
            END $$""")
        await conn.execute(f"ALTER ROLE {role} PASSWORD '{password}'")
        await conn.execute(f"GRANT {member_of} TO {role}")
    finally:
        await conn.close()
    return role


async def ensure_worker_role(admin_url: str, password: str = WORKER_PASSWORD) -> str:
    """The LOGIN role the workers run as: a member of stock_ledger_app, which migrations grant exactly what the
    worker needs."""
    return await ensure_login_role(admin_url, WORKER_ROLE, password, "stock_ledger_app")


async def create_migrated_database(admin_url: str, name: str) -> str:
    """A new database `name`, migrated as the owner, with the worker role ready; its owner URL."""
    await ensure_worker_role(admin_url)
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    owner_url = url_for(admin_url, name)
    await migrate(owner_url, find_migrations_dir(None))
    return owner_url


async def drop_database(admin_url: str, name: str) -> None:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@contextlib.asynccontextmanager
async def kafka_admin(kafka: str) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def set_topic_config(admin: AIOKafkaAdminClient, topic: str, configs: dict[str, str],
                           within: float = 30) -> None:
    """Alter a topic's configs (as an operator would) and return once the broker reports them: AlterConfigs
    answers an error code rather than raising (a forwarded request that timed out on a loaded host), so a test
    that ignored it would wait for a change that never happened."""
    deadline = time.monotonic() + within
    while True:
        (response,) = await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs)])
        errors = [f"{code} {message}" for code, message, *_ in response.resources if code != 0]
        described = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic, dict.fromkeys(configs))])
        seen = {entry[0]: entry[1] for response in described
                for _code, _message, _type, _name, entries, *_ in response.resources for entry in entries}
        if not errors and all(seen.get(k) == v for k, v in configs.items()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"topic {topic}: configs {configs} not applied within {within}s "
                                 f"(alter errors {errors}, described {seen})")
        await asyncio.sleep(0.5)


async def create_topic(kafka: str, name: str, partitions: int) -> None:
    """A new topic, returned once every partition has a leader (producing before that only logs
    NotLeaderForPartition retries)."""
    async with kafka_admin(kafka) as admin:
        await admin.create_topics([NewTopic(name, partitions, 1)])
        for _ in range(100):
            described = await admin.describe_topics([name])
            parts = described[0]["partitions"] if described and described[0]["error_code"] == 0 else []
            if len(parts) == partitions and all(p["leader"] >= 0 for p in parts):
                break
            await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)


async def delete_topics(kafka: str, names: list[str]) -> None:
    """Cleanup: a topic that cannot be deleted is said on stderr, not raised."""
    if not names:
        return
    try:
        async with kafka_admin(kafka) as admin:
            await admin.delete_topics(names)
    except Exception as exc:  # cleanup: say it, go on
        print(f"could not delete the topics {', '.join(names)}: {exc}", file=sys.stderr)


async def end_offsets(kafka: str, topic: str, partitions: int) -> dict[int, int]:
    """partition -> log end offset."""
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        return {tp.partition: int(o) for tp, o in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


def worker_env(kafka: str, database_url: str, topic: str, group: str, **extra: str) -> dict[str, str]:
    """The environment of a `stock-ledger` process: the caller's without any STOCK_LEDGER_ setting of its own,
    these services, topic and group, JSON logs, and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCK_LEDGER_")}
    env |= {"KAFKA_BOOTSTRAP_SERVERS": kafka, "DATABASE_URL": database_url, "STOCK_LEDGER_TOPIC": topic,
            "STOCK_LEDGER_GROUP_ID": group, "STOCK_LEDGER_LOG_FORMAT": "json"}
    return env | extra


# A gated worker has its imports done, then waits for a line on stdin (`WorkerProcess.go`): a rolling restart's
# replacement is ready to start at once, so Python's start-up on a busy machine is not measured as downtime.
# The worker with everything imported, waiting for a line on stdin before it starts (a start that is timed).
_GATED = "import sys; from stock_ledger import cli, worker; sys.stdin.readline(); sys.exit(cli.main(['run']))"


def spawn_worker(env: dict[str, str], log: Path, *, gated: bool = False) -> subprocess.Popen[bytes]:
    """`stock-ledger run` on this interpreter, stdout and stderr to `log`."""
    argv = [sys.executable, "-c", _GATED] if gated else [sys.executable, "-m", "stock_ledger", "run"]
    with log.open("wb") as out:
        return subprocess.Popen(argv, env=env, stdin=subprocess.PIPE if gated else None, stdout=out,
                                stderr=subprocess.STDOUT)


@dataclass
class WorkerProcess:
    """One `stock-ledger run` process: its HTTP port (metrics, health), its log and its environment."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    env: dict[str, str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.signal(signal.SIGCONT)  # a SIGSTOPped process dies only once it runs again
        self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def go(self) -> None:
        """Let a gated worker start."""
        if self.proc.stdin is not None:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()

    def ready(self) -> bool:
        return self.get("/readyz", timeout=1)[0] == 200

    def get(self, path: str, timeout: float = 2) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, OSError):
            return 0, ""  # not listening (yet, or any more)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample from the real /metrics endpoint (None if absent)."""
        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415 - keep this module light

        _, body = self.get("/metrics")
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                    return float(sample.value)
        return None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_tail(self, lines: int) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def start_worker(env: dict[str, str], log: Path, *, gated: bool = False) -> WorkerProcess:
    """`spawn_worker` with its HTTP server on a free port (STOCK_LEDGER_METRICS_PORT)."""
    port = free_port()
    env = env | {"STOCK_LEDGER_METRICS_PORT": str(port)}
    return WorkerProcess(spawn_worker(env, log, gated=gated), port, log, env)


async def stop_workers(workers: Sequence[WorkerProcess], grace: float) -> None:
    """SIGTERM to every worker at once, then wait for each; one still running after `grace` seconds is killed."""
    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        try:
            await asyncio.to_thread(w.wait, grace)
        except subprocess.TimeoutExpired:
            w.kill()


def _nothing() -> None:
    pass


async def wait_until(condition: Callable[[], Awaitable[bool]], within: float, failure: str, *,
                     check: Callable[[], None] = _nothing, every: float = 0.1) -> None:
    """Poll `condition` every `every` seconds until it holds; `check` between polls (a process still alive? it
    raises if not); RuntimeError(failure) after `within` seconds."""
    deadline = time.monotonic() + within
    while not await condition():
        check()
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        await asyncio.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def produce(kafka: str, topic: str, count: int, **options: Any) -> int:
    """`stock-ledger produce`'s load generator (deterministic movements, keyed by SKU) to `topic` at `kafka`."""
    settings = load_settings({"KAFKA_BOOTSTRAP_SERVERS": kafka, "STOCK_LEDGER_TOPIC": topic})
    return await load.produce(settings, count, **options)
