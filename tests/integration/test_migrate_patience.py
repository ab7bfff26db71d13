"""`stock-ledger migrate` on a real PostgreSQL: it waits for a database that is not up yet, and its DDL never
queues behind a running transaction for longer than lock_timeout (it retries instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from stock_ledger.errors import StockLedgerError
from stock_ledger.migrate import MigrateOptions, migrate
from tests.support.helpers import free_port, scratch_database

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from tests.support.helpers import Env, Services

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def _with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    credentials, _, _ = parts.netloc.rpartition("@")
    return urlunsplit((parts.scheme, f"{credentials}@127.0.0.1:{port}", parts.path, parts.query, parts.fragment))


@contextlib.asynccontextmanager
async def proxy(port: int, target_url: str) -> AsyncIterator[None]:
    """A TCP proxy on `port` to the real PostgreSQL: the database 'comes up' when this starts listening."""
    target = urlsplit(target_url)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(target.hostname, target.port or 5432)
        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield
    finally:
        server.close()


@pytest.fixture
def migrations() -> Path:
    return Path(__file__).resolve().parents[2] / "migrations"


@pytest_asyncio.fixture
async def empty_database(services: Services) -> AsyncIterator[str]:
    async with scratch_database(services) as name:
        yield services.url_for(name)


async def test_waits_for_a_database_that_is_not_up_yet(empty_database: str, worker_role: str,
                                                       migrations: Path) -> None:
    """The database's port refuses connections for 3 s, then accepts: migrate logs a progress line per attempt
    (attempt, seconds waited, the error), then applies every migration and exits normally."""
    port = free_port()
    url = _with_port(empty_database, port)
    started = time.monotonic()
    with capture_logs() as logs:
        task = asyncio.create_task(migrate(url, migrations, MigrateOptions(deadline_seconds=60)))
        await asyncio.sleep(3)
        assert not task.done(), "migrate gave up while the database was not up yet"
        async with proxy(port, empty_database):
            applied = await asyncio.wait_for(task, 60)
    assert applied[0] == "0001_ledger.sql"
    waits = [e for e in logs if e["event"] == "migration.waiting_for_database"]
    assert len(waits) >= 2
    assert "ConnectionRefusedError" in waits[0]["error"] or "OSError" in waits[0]["error"]
    assert [w["attempt"] for w in waits] == list(range(1, len(waits) + 1))
    assert time.monotonic() - started >= 3


async def test_gives_up_after_the_deadline_saying_what_to_check(empty_database: str, migrations: Path) -> None:
    """Nothing listens, deadline 2 s: migrate fails after about 2 s, naming the variable and what to check."""
    url = _with_port(empty_database, free_port())
    started = time.monotonic()
    with pytest.raises(StockLedgerError) as caught:
        await migrate(url, migrations, MigrateOptions(deadline_seconds=2))
    assert 2 <= time.monotonic() - started < 15
    assert "STOCK_LEDGER_MIGRATE_DEADLINE_SECONDS" in str(caught.value)
    assert "PostgreSQL is up" in str(caught.value)


async def test_ddl_blocked_by_a_held_lock_retries_and_never_stalls_the_workers(
    database: Env, migrations: Path,
) -> None:
    """1. Migration 0006 is pending and a worker-like session holds a lock on rejected_movements (an open batch
       transaction) for 4 s.
    2. migrate (lock_timeout 300 ms) gives up the lock wait, logs migration.lock_timeout, backs off, retries.
    3. Meanwhile the worker role's inserts into rejected_movements are never queued behind migrate's waiting
       ALTER for longer than about lock_timeout.
    4. Once the lock is released the migration succeeds."""
    owner = await asyncpg.connect(database.owner_url)
    try:
        await owner.execute("DELETE FROM schema_migrations WHERE version = 6")  # 0006 is idempotent: pending again
    finally:
        await owner.close()
    holder = await asyncpg.connect(database.worker_url)
    other = await asyncpg.connect(database.worker_url)
    try:
        hold = holder.transaction()
        await hold.start()
        await holder.fetch("SELECT 1 FROM rejected_movements LIMIT 1")  # ACCESS SHARE until the transaction ends
        with capture_logs() as logs:
            task = asyncio.create_task(migrate(database.owner_url, migrations,
                                               MigrateOptions(deadline_seconds=60, lock_timeout_ms=300)))
            slowest = 0.0
            for i in range(8):
                await asyncio.sleep(0.5)
                started = time.monotonic()
                await other.execute(
                    "INSERT INTO rejected_movements (kafka_topic, kafka_partition, kafka_offset, reason_code, reason)"
                    " VALUES ('t', 0, $1, 'invalid_json', 'test')", i)
                slowest = max(slowest, time.monotonic() - started)
            assert not task.done()
            await hold.rollback()
            applied = await asyncio.wait_for(task, 30)
    finally:
        await holder.close()
        await other.close()
    assert applied == ["0006_operator.sql"]
    retries = [e for e in logs if e["event"] == "migration.lock_timeout"]
    assert retries, "migrate never hit lock_timeout although the table was locked"
    assert retries[0]["migration"] == "0006_operator.sql"
    assert slowest < 1.5, f"a worker insert waited {slowest:.1f}s behind migrate's DDL"
