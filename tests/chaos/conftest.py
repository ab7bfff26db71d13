"""The HA PostgreSQL pair for the database-fault tests: `scripts/postgres.sh ha`, an asynchronous streaming primary
and standby on their own ports (5441, 5442), beside the shared cluster the rest of the suite uses.

The pair is the scripts' own: with services from the environment (DATABASE_URL) or from testcontainers there is no
pair to switch over or fail over, and the tests that need it are skipped, saying so. Each test starts from a healthy
pair (`ha start` heals what the previous test's failover left) and a fresh database on it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import pytest_asyncio

from stock_ledger.migrate import migrate
from tests.support.helpers import Env, Services, SteadyLoad, WorkerPool, scratch_database
from tests.support.services import WORKER_PASSWORD, WORKER_ROLE, script
from tests.support.toxiproxy import Proxy, Toxiproxy, find_server

ROOT = Path(__file__).resolve().parents[2]


def ha(*args: str) -> str:
    """`scripts/postgres.sh ha <args>`'s stdout; a failure fails the test with the script's own words."""
    done = script("postgres.sh", "ha", *args)
    if done.returncode != 0:
        pytest.fail(f"scripts/postgres.sh ha {' '.join(args)} failed ({done.returncode}):\n"
                    f"{done.stderr}\n{done.stdout}")
    return done.stdout.strip()


@dataclass(frozen=True)
class Pair:
    """The pair as the tests drive it: its scripts' commands and its URLs (multi-host, read-write)."""

    owner_url: str
    worker_url: str

    def run(self, *args: str) -> str:
        return ha(*args)

    def status(self) -> tuple[int, str]:
        """`ha status`: its exit code (0: healthy) and its report."""
        done = script("postgres.sh", "ha", "status")
        return done.returncode, done.stdout.strip()

    @property
    def ports(self) -> list[int]:
        hosts = urlsplit(self.owner_url).netloc.rsplit("@", 1)[1]
        return [int(h.rpartition(":")[2]) for h in hosts.split(",")]

    def node_url(self, port: int, database: str) -> str:
        """One node only (whatever its role), as the owner: to look at a standby or a primary directly."""
        parts = urlsplit(self.owner_url)
        userinfo = parts.netloc.rsplit("@", 1)[0]
        return urlunsplit((parts.scheme, f"{userinfo}@127.0.0.1:{port}", f"/{database}", "", ""))

    def services(self, kafka: str) -> Services:
        """The tests' Services with this pair as the database (scratch databases are created on the primary)."""
        return Services(kafka, self.owner_url, origin="scripts-ha")


@pytest.fixture(scope="session")
def ha_session(services: Services) -> Iterator[Pair]:
    if services.origin != "scripts":
        pytest.skip(f"needs the PostgreSQL pair of 'scripts/postgres.sh ha' (services came from {services.origin}: "
                    "unset KAFKA_BOOTSTRAP_SERVERS/DATABASE_URL and stop the Docker engine to use the scripts)")
    ha("start")
    yield Pair(ha("url"), ha("worker-url"))
    script("postgres.sh", "ha", "stop")


@pytest.fixture
def ha_pair(ha_session: Pair) -> Pair:
    """A healthy pair: a primary and a standby streaming from it (whichever node is which)."""
    ha_session.run("start")
    code, report = ha_session.status()
    assert code == 0, f"the pair is not healthy after 'ha start':\n{report}"
    return ha_session


@pytest.fixture
def ha_services(services: Services, ha_pair: Pair) -> Services:
    return ha_pair.services(services.kafka)


@pytest_asyncio.fixture
async def ha_database(ha_services: Services) -> AsyncIterator[Env]:
    """A fresh, migrated database on the pair's primary; the URLs reach whichever node is the primary."""
    async with scratch_database(ha_services) as name:
        owner_url = ha_services.url_for(name)
        await replicated(owner_url)
        await migrate(owner_url, ROOT / "migrations")
        yield Env(owner_url=owner_url, worker_url=ha_services.url_for(name, WORKER_ROLE, WORKER_PASSWORD), name=name)


async def replicated(url: str, within: float = 20) -> None:
    """Wait until a multi-host session to a new database opens. asyncpg tries the hosts in order and moves on only
    after an OSError: a standby that has not replayed CREATE DATABASE yet answers "does not exist", which ends the
    attempt instead of moving on to the primary."""
    deadline = time.monotonic() + within
    while True:
        try:
            conn = await asyncpg.connect(url)
        except asyncpg.InvalidCatalogNameError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        await conn.close()
        return


@pytest.fixture
def ha_workers(ha_services: Services, ha_database: Env, topic: str, tmp_path: Path) -> Iterator[WorkerPool]:
    """`stock-ledger run` subprocesses on the pair's multi-host URL; every one still alive is killed at the end."""
    pool = WorkerPool(ha_services, ha_database, topic, group=f"stock-ledger-ha-{uuid.uuid4().hex[:8]}", logs=tmp_path)
    yield pool
    pool.kill_all()


@pytest_asyncio.fixture
async def steady() -> AsyncIterator[Callable[[str, str, int, int], SteadyLoad]]:
    """SteadyLoad(kafka, topic, rate, seed) for a test; one the test did not finish is cancelled at its end."""
    started: list[SteadyLoad] = []

    def start(kafka: str, topic: str, rate: int, seed: int) -> SteadyLoad:
        started.append(SteadyLoad(kafka, topic, rate, seed))
        return started[-1]

    yield start
    for load in started:
        await load.cancel()


@pytest.fixture(scope="session")
def toxiproxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Toxiproxy]:
    """Shopify's toxiproxy (built by scripts/tools.sh), serving its API on a free port of 127.0.0.1."""
    binary = find_server()
    if binary is None:
        pytest.fail("toxiproxy-server is not on PATH nor in ~/.cache/stock-ledger/bin: run scripts/tools.sh "
                    "(make tools), which builds it from the Go module proxy", pytrace=False)
    server = Toxiproxy(binary, tmp_path_factory.mktemp("toxiproxy") / "toxiproxy.log")
    yield server
    server.stop()


@pytest.fixture
def postgres_proxy(services: Services, toxiproxy: Toxiproxy) -> Iterator[Proxy]:
    """A proxy in front of the tests' PostgreSQL (the host and port of its URL, whichever way the services came),
    with no toxic yet; deleted at the end. `proxy.route(url)` is a URL through it."""
    upstream = urlsplit(services.admin_url).netloc.rpartition("@")[2]
    if "," in upstream:
        pytest.fail(f"the network-fault tests put one proxy in front of one PostgreSQL; DATABASE_URL names several "
                    f"hosts ({upstream}): point it at one", pytrace=False)
    proxy = toxiproxy.proxy(f"postgres-{uuid.uuid4().hex[:8]}", upstream)
    yield proxy
    toxiproxy.delete(proxy)
