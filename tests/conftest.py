"""Real services for the tests: a real Apache Kafka broker and a real PostgreSQL.

Where they come from, in order:
1. KAFKA_BOOTSTRAP_SERVERS and DATABASE_URL are both set: use them (DATABASE_URL must be able to CREATE DATABASE and
   CREATE ROLE; each test gets its own database and topic).
2. A Docker engine answers (DOCKER_HOST, or podman's Docker API: `make test-testcontainers`): testcontainers start
   Kafka (STOCK_LEDGER_KAFKA_IMAGE, default apache/kafka:4.1.1) and PostgreSQL (STOCK_LEDGER_POSTGRES_IMAGE,
   default postgres:15).
3. Otherwise: scripts/kafka.sh and scripts/postgres.sh start them on this machine (idempotent).
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from stock_ledger.migrate import migrate
from tests.support.helpers import Env, Services, WorkerPool, scratch_database, scratch_topic
from tests.support.services import WORKER_PASSWORD, ensure_worker_role, free_port, local_kafka, script

ROOT = Path(__file__).resolve().parents[1]


def _docker_engine() -> bool:
    """Does a Docker engine answer /_ping? (A raw probe: the docker SDK leaks its socket when none runs.)"""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: str | tuple[str, int] = host.removeprefix("unix://")
        elif host.startswith("tcp://"):
            sock = socket.socket()
            name, _, port = host.removeprefix("tcp://").partition(":")
            address = (name, int(port or 2375))
        else:
            return False
        with sock:
            sock.settimeout(3)
            sock.connect(address)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in sock.recv(64)
    except OSError:
        return False


def _script(name: str, *args: str) -> str:
    done = script(name, *args)
    if done.returncode != 0:
        pytest.fail(f"scripts/{name} {' '.join(args)} failed ({done.returncode}):\n{done.stderr}\n{done.stdout}")
    return done.stdout.strip()


def _kafka_container(image: str) -> Any:
    """apache/kafka's own contract (KAFKA_* variables become server.properties) for a single KRaft node.

    testcontainers' KafkaContainer drives Confluent's image layout (/etc/confluent/docker/...) and its
    with_kraft() refuses any tag below 7.0.0, so apache/kafka:4.1.1 cannot start through it. The advertised
    listener must name the port the host sees, so that port is chosen before the start.
    """
    from testcontainers.core.container import DockerContainer  # noqa: PLC0415
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy  # noqa: PLC0415

    port = free_port()
    env = {
        "KAFKA_NODE_ID": "1", "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": "PLAINTEXT://0.0.0.0:9092,CONTROLLER://127.0.0.1:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{port}",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@127.0.0.1:9093",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1", "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1", "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        # The same fast-test settings as scripts/kafka.sh.
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0", "KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS": "1000",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
    }
    container = DockerContainer(image).with_bind_ports(9092, port)
    for key, value in env.items():
        container = container.with_env(key, value)
    return container.waiting_for(LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(120)), port


def _testcontainers() -> Iterator[Services]:
    try:  # testcontainers >= 4.14 moved the module and warns (an error here) on the old path
        from testcontainers.community.postgres import PostgresContainer  # noqa: PLC0415
    except ImportError:
        from testcontainers.postgres import PostgresContainer  # noqa: PLC0415

    kafka, port = _kafka_container(os.environ.get("STOCK_LEDGER_KAFKA_IMAGE", "apache/kafka:4.1.1"))
    with kafka, PostgresContainer(os.environ.get("STOCK_LEDGER_POSTGRES_IMAGE", "postgres:15")) as p:
        url = p.get_connection_url(driver=None).replace("postgresql+psycopg2://", "postgresql://")
        yield Services(f"127.0.0.1:{port}", url, origin="testcontainers")


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    kafka, db = os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), os.environ.get("DATABASE_URL")
    if kafka and db:
        yield Services(kafka, db, origin="environment")
        return
    if _docker_engine():
        yield from _testcontainers()
        return
    _script("kafka.sh", "start")
    _script("postgres.sh", "start")
    # KAFKA_PORT: the port scripts/kafka.sh uses (a second broker of one's own runs on another).
    yield Services(local_kafka(), _script("postgres.sh", "url"), origin="scripts",
                   root=ROOT)


@pytest.fixture(scope="session")
def worker_role(services: Services) -> str:
    """The least-privileged LOGIN role the workers run as (a member of stock_ledger_app)."""

    return asyncio.run(ensure_worker_role(services.admin_url, WORKER_PASSWORD))


@pytest_asyncio.fixture
async def database(services: Services, worker_role: str) -> AsyncIterator[Env]:
    """A fresh, migrated database; `owner_url` for setup and checks, `worker_url` for the workers."""
    async with scratch_database(services) as name:
        owner_url = services.url_for(name)
        await migrate(owner_url, ROOT / "migrations")
        yield Env(owner_url=owner_url,
                  worker_url=services.url_for(name, user=worker_role, password=WORKER_PASSWORD), name=name)


@pytest_asyncio.fixture
async def topic(services: Services) -> AsyncIterator[str]:
    """A fresh topic with the production shape: 24 partitions."""
    async with scratch_topic(services) as name:
        yield name


@pytest.fixture
def workers(services: Services, database: Env, topic: str, tmp_path: Path) -> Iterator[WorkerPool]:
    """Starts `stock-ledger run` subprocesses; every one still alive is killed at the end."""
    pool = WorkerPool(services, database, topic, group=f"stock-ledger-test-{uuid.uuid4().hex[:8]}", logs=tmp_path)
    yield pool
    pool.kill_all()
