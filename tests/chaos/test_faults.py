"""Churn and infrastructure faults under a steady producer: the ledger ends exact every time."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time

import asyncpg
import pytest

from tests.support.helpers import Env, Services, WorkerPool, assert_atomic, assert_exact, eventually, wait_drained
from tests.support.services import produce

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.asyncio]

FAST = {"STOCK_LEDGER_SESSION_TIMEOUT_MS": "4000", "STOCK_LEDGER_LOCK_TIMEOUT_MS": "1000",
        "STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS": "5000"}


async def test_churn_of_starts_sigterms_and_sigkills_for_a_minute(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """For a minute, every 1-4 s a worker is started, SIGTERMed or SIGKILLed (1 to 4 alive at any time), while
    movements arrive at 1,000/s. The group rebalances constantly. Then the churn stops: the ledger is exact."""
    rng = random.Random()
    producer = asyncio.create_task(produce(services.kafka, topic, 60_000, rate=1_000, seed=3, show_progress=False))
    workers.start(**FAST)
    actions = {"start": 0, "sigterm": 0, "sigkill": 0}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        await asyncio.sleep(rng.uniform(1, 4))
        alive = workers.alive()
        choice = rng.choice(["start", "sigterm", "sigkill"])
        if len(alive) <= 1:
            choice = "start"
        elif len(alive) >= 4:
            choice = rng.choice(["sigterm", "sigkill"])
        if choice == "start":
            workers.start(**FAST)
        else:
            rng.choice(alive).signal(signal.SIGTERM if choice == "sigterm" else signal.SIGKILL)
        actions[choice] += 1
        rows, stored = await assert_atomic(database, topic, workers.group)
        assert rows == stored
    await producer
    if not workers.alive():
        workers.start(**FAST)
    await wait_drained(services, database, topic, workers.group, 180, workers)
    await assert_exact(services, database, topic, workers.group, rows=60_000, pool=workers)
    workers.assert_no_tracebacks()
    assert actions["sigterm"] + actions["sigkill"] >= 8, actions
    # A SIGTERMed worker always exits 0 (graceful), whatever it was doing.
    stopped = [w for w in workers.started if not w.alive()]
    assert all(w.proc.returncode in (0, -signal.SIGKILL) for w in stopped), workers.logs_tail()


async def _terminate_workers(admin_url: str, database: str) -> int:
    conn = await asyncpg.connect(admin_url)
    try:
        return len(await conn.fetch(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = $1 AND application_name LIKE 'stock-ledger%' AND pid <> pg_backend_pid()", database))
    finally:
        await conn.close()


async def test_terminated_database_connections_are_survived(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Every 2-3 s, pg_terminate_backend kills every worker connection (mid-transaction or not) while two
    workers apply 1,000 movements/s. They reconnect and retry; nothing is lost or applied twice."""
    producer = asyncio.create_task(produce(services.kafka, topic, 25_000, rate=1_000, seed=5, show_progress=False))
    pool = [workers.start(), workers.start()]
    terminated = 0
    while not producer.done():
        await asyncio.sleep(random.uniform(2, 3))
        terminated += await _terminate_workers(services.admin_url, database.name)
    await producer
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=25_000, pool=workers)
    workers.assert_no_tracebacks()
    assert terminated >= 5
    assert all(w.alive() for w in pool), workers.logs_tail()
    retries = sum(w.metric("stock_ledger_retries_total", {"cause": "database"}) or 0 for w in pool)
    assert retries >= 1


async def test_a_postgresql_restart_mid_run_is_ridden_out(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """PostgreSQL restarts (fast shutdown: open transactions abort) while a worker applies 1,000 movements/s.
    The worker retries until the database is back, then carries on; the ledger is exact."""
    producer = asyncio.create_task(produce(services.kafka, topic, 20_000, rate=1_000, seed=9, show_progress=False))
    w = workers.start()
    await eventually(lambda: (w.metric("stock_ledger_batches_committed_total") or 0) >= 5, 60, "work", workers)
    await asyncio.to_thread(services.control, "postgres.sh", "restart")
    await producer
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=20_000, pool=workers)
    workers.assert_no_tracebacks()
    assert w.alive(), workers.logs_tail()
    assert (w.metric("stock_ledger_retries_total", {"cause": "database"}) or 0) >= 1


async def test_a_broker_restart_mid_run_is_ridden_out(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The Kafka broker restarts while a worker drains a backlog; movements produced after the restart are
    applied too. The worker never exits; the ledger is exact."""
    await produce(services.kafka, topic, 60_000, seed=13, show_progress=False)
    w = workers.start(STOCK_LEDGER_BATCH_MAX_RECORDS="1000")
    await eventually(lambda: (w.metric("stock_ledger_batches_committed_total") or 0) >= 3, 60, "work", workers)
    try:
        await asyncio.to_thread(services.control, "kafka.sh", "restart")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(services.control, "kafka.sh", "start")
    await produce(services.kafka, topic, 10_000, seed=14, show_progress=False)
    await wait_drained(services, database, topic, workers.group, 180, workers)
    await assert_exact(services, database, topic, workers.group, rows=70_000, pool=workers)
    workers.assert_no_tracebacks()
    assert w.alive(), workers.logs_tail()
