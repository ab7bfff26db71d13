"""Secured connections on the real services: Kafka's SASL_SSL listener (SCRAM-SHA-512 over TLS, opened by
scripts/kafka.sh) and PostgreSQL over TLS with sslmode=verify-full (scripts/postgres.sh), both with certificates
from the scripts' local CA.

Test setup and the independent ledger check talk to the broker's PLAINTEXT listener and as the database owner;
everything the product does goes through the secured endpoints only.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from tests.support.helpers import Env, Services, WorkerPool, assert_exact, eventually, wait_drained
from tests.support.services import produce

pytestmark = [pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]


def _script(name: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in {"KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL"}}
    done = subprocess.run(["bash", str(ROOT / "scripts" / name), *args], check=False, capture_output=True,
                          text=True, timeout=600, env=env)
    if done.returncode != 0:
        pytest.fail(f"scripts/{name} {' '.join(args)} failed ({done.returncode}):\n{done.stderr}\n{done.stdout}")
    return done.stdout.strip()


class Secure:
    """The secured endpoints: the worker environment for Kafka, and the TLS query for PostgreSQL URLs."""

    def __init__(self, kafka_env: dict[str, str], pg_tls: dict[str, str]) -> None:
        self.kafka_env = kafka_env
        self.pg_tls = pg_tls

    @property
    def sasl_password(self) -> str:
        return Path(self.kafka_env["KAFKA_SASL_PASSWORD_FILE"]).read_text().strip()

    @property
    def ca_file(self) -> str:
        return self.kafka_env["KAFKA_SSL_CA_FILE"]

    def database_url(self, url: str, **query: str) -> str:
        """`url` with the verify-full parameters of scripts/postgres.sh (plus `query`)."""
        params = "&".join(f"{k}={v}" for k, v in {**self.pg_tls, **query}.items())
        return f"{url}?{params}"

    def env(self, db: Env, **extra: str) -> dict[str, str]:
        return {**self.kafka_env, "DATABASE_URL": self.database_url(db.worker_url),
                "STOCK_LEDGER_DATABASE_SSLMODE_MIN": "verify-full", **extra}


@pytest.fixture(scope="session")
def secure(services: Services) -> Secure:
    """The scripts' secured listeners (the `services` fixture has run `kafka.sh start` and `postgres.sh start`)."""
    if services.root is None:
        pytest.fail(f"the security tests need the secured listeners of scripts/kafka.sh and scripts/postgres.sh "
                    f"(services came from: {services.origin}); unset KAFKA_BOOTSTRAP_SERVERS/DATABASE_URL")
    lines = _script("kafka.sh", "secure-env").splitlines()
    exports = dict(line.removeprefix("export ").split("=", 1) for line in lines)
    host, _, port = exports["KAFKA_BOOTSTRAP_SERVERS"].partition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError:
        pytest.fail(f"nothing listens on {exports['KAFKA_BOOTSTRAP_SERVERS']}: the broker was started by an older "
                    "scripts/kafka.sh without the SASL_SSL listener; run `scripts/kafka.sh restart`")
    url = _script("postgres.sh", "verify-full-url")
    return Secure(exports, dict(parse_qsl(urlsplit(url).query)))


def _run(command: str, env: dict[str, str], *args: str, timeout: float = 120) -> tuple[int, str, float]:
    """`stock-ledger COMMAND` with exactly `env` (nothing inherited but PATH): exit code, stdout+stderr, seconds."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "stock_ledger", command, *args], capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", ""), "STOCK_LEDGER_LOG_FORMAT": "json", **env},
                          timeout=timeout, check=False)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


async def _ssl_sessions(db: Env, application_name: str) -> list[bool]:
    """Whether each current session of `application_name` (a LIKE pattern) on this database runs over TLS."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        rows = await conn.fetch("""
            SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
            WHERE a.datname = $1 AND a.application_name LIKE $2""", db.name, application_name)
    finally:
        await conn.close()
    return [r[0] for r in rows]


@pytest.mark.asyncio
async def test_a_worker_drains_over_sasl_ssl_and_verify_full_and_survives_a_sigkill(
    services: Services, database: Env, topic: str, workers: WorkerPool, secure: Secure,
) -> None:
    """30,000 movements; a worker connected only through the SASL_SSL listener and a verify-full PostgreSQL URL
    (with STOCK_LEDGER_DATABASE_SSLMODE_MIN=verify-full) starts draining and is SIGKILLed mid-way; a second one
    finishes. The ledger is exact, every worker session runs over TLS, the position monitor (its own Kafka and
    database clients) reports the log end, and no log line holds the SASL password."""
    await produce(services.kafka, topic, 30_000, show_progress=False)
    env = secure.env(database)
    first = workers.start(**env)

    async def some_applied() -> bool:
        conn = await asyncpg.connect(database.owner_url)
        try:
            return bool(await conn.fetchval("SELECT count(*) FROM stock_movements"))
        finally:
            await conn.close()

    await eventually(some_applied, 90, "the first worker to apply movements", workers)
    # The worker's sessions are named after its group (stock-ledger/<group>): the batch session and the monitor lease.
    assert set(await _ssl_sessions(database, "stock-ledger/%")) == {True}
    first.signal(signal.SIGKILL)
    first.wait(10)

    second = workers.start(**env)
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=30_000, pool=workers)
    await eventually(lambda: second.metric("stock_ledger_partition_log_end_offset") is not None, 30,
                     "the position monitor to read the log end over SASL_SSL", workers)
    assert set(await _ssl_sessions(database, "stock-ledger-metrics")) <= {True}
    assert set(await _ssl_sessions(database, "stock-ledger/%")) == {True}
    second.signal(signal.SIGTERM)
    assert second.wait(20) == 0
    workers.assert_no_tracebacks()
    for w in workers.started:
        assert secure.sasl_password not in w.log_text()


@pytest.mark.asyncio
async def test_create_topic_produce_and_verify_work_over_the_secured_endpoints(
    services: Services, database: Env, workers: WorkerPool, secure: Secure,
) -> None:
    """`create-topic`, `produce` and `verify` with only the secured endpoints configured: the topic is created,
    500 movements land in it, a worker applies them, and verify exits 0 counting 500 rows."""
    name = f"warehouse.movements.secure-{uuid.uuid4().hex[:10]}"
    env = secure.env(database, STOCK_LEDGER_TOPIC=name, STOCK_LEDGER_GROUP_ID=workers.group)
    try:
        code, out, _ = _run("create-topic", env, "--partitions", "6")
        assert code == 0, out
        assert f"topic {name}: created" in out
        code, out, _ = _run("produce", env, "--count", "500")
        assert code == 0, out
        workers.topic = name
        workers.start(**env)
        await wait_drained(services, database, name, workers.group, 60, workers)
        code, out, _ = _run("verify", env, "--expect", "500", "--wait", "30")
        assert code == 0, out
        assert secure.sasl_password not in out
    finally:
        admin = AIOKafkaAdminClient(bootstrap_servers=services.kafka)
        await admin.start()
        try:
            await admin.delete_topics([name])
        finally:
            await admin.close()


def _other_ca(tmp: Path) -> str:
    """A CA that signed nothing the services present."""
    subprocess.run(["openssl", "req", "-x509", "-new", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    "/CN=some other CA", "-keyout", str(tmp / "other.key"), "-out", str(tmp / "other.crt")],
                   check=True, capture_output=True)
    return str(tmp / "other.crt")


class TestRefusals:
    """What a retry cannot fix fails fast: exit 1 (2 for configuration) well inside the retry deadline (120 s
    here), one line saying which problem, and neither the secret in question nor any other in the output."""

    def _assert_fails_fast(self, code: int, out: str, elapsed: float, expected_code: int, says: str,
                           secrets: list[str]) -> None:
        assert code == expected_code, out
        assert says in out, out
        assert elapsed < 30, f"took {elapsed:.0f}s: retried instead of failing fast\n{out}"
        assert "Traceback" not in out, out
        for secret in secrets:
            assert secret not in out, "a secret was printed"

    def test_a_wrong_sasl_password(self, database: Env, topic: str, secure: Secure) -> None:
        wrong = f"wrong-{uuid.uuid4().hex}"
        env = secure.env(database, STOCK_LEDGER_TOPIC=topic, STOCK_LEDGER_RETRY_DEADLINE_SECONDS="120",
                         KAFKA_SASL_PASSWORD=wrong, STOCK_LEDGER_METRICS_PORT="0")
        del env["KAFKA_SASL_PASSWORD_FILE"]
        self._assert_fails_fast(*_run("run", env), 1, "rejected the SASL login", [wrong, secure.sasl_password])

    def test_a_ca_that_did_not_sign_the_broker(self, database: Env, topic: str, secure: Secure,
                                               tmp_path: Path) -> None:
        env = secure.env(database, STOCK_LEDGER_TOPIC=topic, STOCK_LEDGER_RETRY_DEADLINE_SECONDS="120",
                         KAFKA_SSL_CA_FILE=_other_ca(tmp_path), STOCK_LEDGER_METRICS_PORT="0")
        self._assert_fails_fast(*_run("run", env), 1, "untrusted certificate: Kafka", [secure.sasl_password])

    def test_a_hostname_the_broker_certificate_does_not_name(self, database: Env, topic: str,
                                                            secure: Secure) -> None:
        """The scripts' certificates name 127.0.0.1 only, so `localhost` reaches the same listener but mismatches."""
        port = secure.kafka_env["KAFKA_BOOTSTRAP_SERVERS"].rpartition(":")[2]
        env = secure.env(database, STOCK_LEDGER_TOPIC=topic, STOCK_LEDGER_RETRY_DEADLINE_SECONDS="120",
                         KAFKA_BOOTSTRAP_SERVERS=f"localhost:{port}", STOCK_LEDGER_METRICS_PORT="0")
        self._assert_fails_fast(*_run("run", env), 1, "TLS hostname mismatch", [secure.sasl_password])

    def test_a_database_url_below_the_minimum_sslmode(self, database: Env, topic: str, secure: Secure) -> None:
        secret = f"pw-{uuid.uuid4().hex}"
        url = database.worker_url.replace(":stock_ledger_worker@", f":{secret}@") + "?sslmode=require"
        env = secure.env(database, STOCK_LEDGER_TOPIC=topic, DATABASE_URL=url, STOCK_LEDGER_METRICS_PORT="0")
        code, out, elapsed = _run("run", env)
        self._assert_fails_fast(code, out, elapsed, 2, "STOCK_LEDGER_DATABASE_SSLMODE_MIN=verify-full",
                                [secret, secure.sasl_password])
        assert "sslmode=require" in out

    def test_a_database_certificate_no_trusted_ca_signed(self, database: Env, topic: str, secure: Secure,
                                                        tmp_path: Path) -> None:
        secret = f"pw-{uuid.uuid4().hex}"
        url = database.worker_url.replace(":stock_ledger_worker@", f":{secret}@")
        env = secure.env(database, STOCK_LEDGER_TOPIC=topic, STOCK_LEDGER_RETRY_DEADLINE_SECONDS="120",
                         DATABASE_URL=secure.database_url(url, sslrootcert=_other_ca(tmp_path)),
                         STOCK_LEDGER_METRICS_PORT="0")
        self._assert_fails_fast(*_run("run", env), 1, "untrusted certificate: PostgreSQL",
                                [secret, secure.sasl_password])
