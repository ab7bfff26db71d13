"""PgBouncer between the workers and PostgreSQL: Debian's 1.18 with its default configuration (scripts/pgbouncer.sh),
the workers as `stock-ledger run` processes connecting through it, the checks made directly on PostgreSQL.

Session mode works with every protection intact (the session timeouts, zombie termination by the backend's own pid);
transaction and statement mode are refused at start; a startup parameter the pooler refuses is a configuration
error. See docs/pgbouncer.md."""

from __future__ import annotations

import asyncio
import signal
import time
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from scripts.localservices import script

from stock_ledger.clients import session_name
from stock_ledger.produce import produce
from tests.helpers import Env, Services, WorkerPool, assert_exact, eventually, process_state, wait_drained

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]
MODES = ("session", "transaction", "statement")


@pytest.fixture(scope="module")
def poolers(services: Services) -> dict[str, int]:
    """pool mode -> the port of a PgBouncer in that mode in front of the tests' PostgreSQL (left running: the
    script is idempotent, and other test runs may be using it)."""
    if services.root is None:
        pytest.skip(f"PgBouncer is put in front of scripts/postgres.sh's PostgreSQL; services came from "
                    f"{services.origin}")
    ports = {}
    for mode in MODES:
        started = script("pgbouncer.sh", "start", "--mode", mode)
        assert started.returncode == 0, started.stderr
        url = script("pgbouncer.sh", "url", "--mode", mode)
        ports[mode] = int(urlsplit(url.stdout.strip()).port or 0)
    return ports


def via(url: str, port: int, query: str = "") -> str:
    """`url` through the pooler listening on `port` of 127.0.0.1."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit((parts.scheme, f"{userinfo}@127.0.0.1:{port}", parts.path, query or parts.query, ""))


async def backends(db: Env, group: str, state: str | None = None) -> list[asyncpg.Record]:
    """The PostgreSQL backends of the group's worker sessions (as the server sees them, directly)."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        return await conn.fetch(
            "SELECT pid, state, wait_event_type, wait_event, query FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = $1 AND ($2::text IS NULL OR state = $2)",
            session_name(group), state)
    finally:
        await conn.close()


async def test_through_the_default_session_pooler_the_worker_drains_exactly_under_its_lock_timeout(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int],
) -> None:
    """The worker connects through PgBouncer's default session-mode pool (the old worker could not: every connect
    was refused for its lock_timeout startup parameter, and retried). lock_timeout is in force on its own session:
    while a test session (not the group's, so no zombie to terminate) holds consumer_offsets in SHARE mode, the
    worker's claim is seen waiting on the lock directly in pg_stat_activity, then cancelled by lock_timeout (1 s) and
    retried. Released, the worker drains 3,000 movements exactly once."""
    await produce(services.kafka, topic, 3_000, seed=311, show_progress=False)
    blocker = await asyncpg.connect(database.owner_url)
    try:
        await blocker.execute("BEGIN; LOCK TABLE consumer_offsets IN SHARE MODE")
        worker = workers.start(DATABASE_URL=via(database.worker_url, poolers["session"]),
                               STOCK_LEDGER_LOCK_TIMEOUT_MS="1000")

        async def claim_waits_on_the_lock() -> bool:
            return any(b["wait_event_type"] == "Lock" and "consumer_offsets" in b["query"]
                       for b in await backends(database, workers.group))

        await eventually(claim_waits_on_the_lock, 60, "the worker's claim to wait on the lock", workers)
        await eventually(lambda: "canceling statement due to lock timeout" in worker.log_text(), 15,
                         "lock_timeout to cancel the claim", workers)
        assert '"claim.retry"' in worker.log_text()
        assert worker.alive()
    finally:
        await blocker.close()
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=3_000, pool=workers)
    workers.assert_no_tracebacks()


async def test_through_the_session_pooler_a_worker_frozen_in_its_transaction_loses_it_at_the_idle_timeout(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int],
) -> None:
    """idle_in_transaction_session_timeout is in force on the worker's own session behind the pooler: the worker,
    frozen (SIGSTOP) before its third commit, shows in pg_stat_activity as `idle in transaction`; with no other
    worker to claim anything, the server itself ends that session within its 2 s timeout (not 0, as when it was sent
    as a startup parameter and dropped). Thawed, the worker reconnects through the pooler and drains exactly."""
    await produce(services.kafka, topic, 6_000, seed=312, show_progress=False)
    worker = workers.start(DATABASE_URL=via(database.worker_url, poolers["session"]),
                           STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS="2000", STOCK_LEDGER_BATCH_MAX_RECORDS="1000",
                           STOCK_LEDGER_FAULT="before_commit@3:stop")
    await eventually(lambda: process_state(worker.pid) == "T", 60, "the worker to freeze before a commit", workers)
    frozen_at = time.monotonic()
    idle = await backends(database, workers.group, "idle in transaction")
    assert len(idle) == 1, idle

    async def session_ended() -> bool:
        return not await backends(database, workers.group, "idle in transaction")

    await eventually(session_ended, 15, "the server to end the frozen session", workers)
    assert time.monotonic() - frozen_at < 10
    worker.signal(signal.SIGCONT)
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=6_000, pool=workers)


@pytest.mark.chaos
@pytest.mark.parametrize(("fault", "where"), [("before_commit@3:stop", "idle in transaction"),
                                              ("during_copy@3:stop", "active")], ids=["in-transaction", "in-copy"])
async def test_a_worker_frozen_behind_the_pooler_is_terminated_by_the_next_owners_claim(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int], fault: str,
    where: str,
) -> None:
    """Both workers through the session pooler. A freezes (SIGSTOP) inside its batch transaction, before COMMIT or in
    the middle of its COPY (where the server's own timeouts do not reach it), holding its partitions' offset rows;
    the server's idle-in-transaction timeout is set out of reach (10 min). B is assigned A's partitions once A's Kafka
    session expires; its claim waits on those rows, finds A's backend among its blockers by the backend's own pid
    (pg_backend_pid(): behind the pooler get_server_pid() is a made-up number, and pg_blocking_pids() of it is
    empty), terminates it, and drains the backlog within seconds, exactly once."""
    await produce(services.kafka, topic, 20_000, seed=313, show_progress=False)
    fast = {"DATABASE_URL": via(database.worker_url, poolers["session"]), "STOCK_LEDGER_SESSION_TIMEOUT_MS": "4000",
            "STOCK_LEDGER_LOCK_TIMEOUT_MS": "2000", "STOCK_LEDGER_BATCH_MAX_RECORDS": "2000",
            "STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS": "600000"}
    a = workers.start(**fast, STOCK_LEDGER_FAULT=fault)
    await eventually(lambda: process_state(a.pid) == "T", 60, "worker A to freeze inside its transaction", workers)
    frozen = await backends(database, workers.group, where)
    assert len(frozen) == 1, frozen
    if where == "active":
        assert frozen[0]["query"].startswith("COPY"), frozen
        assert frozen[0]["wait_event"] == "ClientRead", frozen
    started = time.monotonic()
    b = workers.start(**fast)
    await wait_drained(services, database, topic, workers.group, 60, workers)
    assert time.monotonic() - started < 45, "B was held up by the frozen zombie"
    assert '"claim.zombies_terminated"' in b.log_text()
    assert str(frozen[0]["pid"]) in next(line for line in b.log_text().splitlines() if "zombies_terminated" in line)
    a.kill()
    await assert_exact(services, database, topic, workers.group, rows=20_000, pool=workers)


@pytest.mark.parametrize("mode", ["transaction", "statement"])
async def test_transaction_and_statement_pooling_are_refused_at_start(
    services: Services, database: Env, topic: str, workers: WorkerPool, poolers: dict[str, int], mode: str,
) -> None:
    """Behind PgBouncer in transaction or statement mode the worker's session is not its own (the advisory-lock lease
    held by two pods, SET leaking to other clients, prepared statements colliding): the worker exits 2 at start, says
    to use pool_mode = session, and writes nothing."""
    await produce(services.kafka, topic, 100, seed=314, show_progress=False)
    worker = workers.start(DATABASE_URL=via(database.worker_url, poolers[mode]))
    assert worker.wait(60) == 2, worker.log_tail(20)
    assert "pool_mode = session" in worker.log_text()
    assert "Traceback" not in worker.log_text()
    conn = await asyncpg.connect(database.owner_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM consumer_offsets") == 0
    finally:
        await conn.close()


async def test_a_startup_parameter_the_pooler_refuses_is_a_configuration_error(
    database: Env, workers: WorkerPool, poolers: dict[str, int],
) -> None:
    """A query parameter in DATABASE_URL becomes a startup parameter; PgBouncer refuses one it does not know. The
    worker exits 2 at once (not retried as a lost connection), naming the parameter and the fix."""
    worker = workers.start(DATABASE_URL=via(database.worker_url, poolers["session"], "search_path=public"))
    assert worker.wait(30) == 2, worker.log_tail(20)
    text = worker.log_text()
    assert "unsupported startup parameter: search_path" in text
    assert "ignore_startup_parameters" in text
    assert '"startup.retry"' not in text
    await asyncio.sleep(0)
