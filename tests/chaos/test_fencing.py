"""Several workers in one group: rebalances, zombies and shutdowns, with the database doing the fencing."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest

from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_atomic,
    assert_exact,
    eventually,
    process_state,
    wait_drained,
)
from tests.support.services import produce

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.asyncio]

# Short timeouts so a frozen worker loses its partitions (session) and its row locks (idle in transaction) fast.
FAST = {
    "STOCK_LEDGER_SESSION_TIMEOUT_MS": "4000",
    "STOCK_LEDGER_LOCK_TIMEOUT_MS": "1000",
    "STOCK_LEDGER_IDLE_IN_TRANSACTION_TIMEOUT_MS": "5000",
}


async def test_cold_start_of_three_workers_on_a_100k_backlog(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """100,000 movements already in the topic; three workers start about a second apart, so the first ones are
    mid-batch when the group rebalances (OpenPanel saw 108,327 rows for 100,000 here). Exactly 100,000 rows."""
    await produce(services.kafka, topic, 100_000, show_progress=False)
    for _ in range(3):
        workers.start()
        await asyncio.sleep(1)
    await wait_drained(services, database, topic, workers.group, 180, workers)
    await assert_exact(services, database, topic, workers.group, rows=100_000, pool=workers)
    workers.assert_no_tracebacks()
    assert all(w.alive() for w in workers.started), workers.logs_tail()


async def test_frozen_workers_are_fenced_when_they_wake(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Two workers under a steady producer.
    1. Worker A freezes itself (SIGSTOP via the crash-point hook) inside its batch transaction, holding row locks.
    2. Its session expires; B is assigned everything; B's claim waits for A's locks, which the server releases
       when A's idle transaction times out; B claims and takes over from A's last committed offsets.
    3. A is thawed: its batch is refused by the epoch compare-and-set (the fenced counter on A's /metrics rises).
    4. Twice more, a random worker is frozen with SIGSTOP from outside for longer than the session, then thawed.
    At the end: no duplicate, no gap, exact stock levels, every offset at the log end."""
    producer = asyncio.create_task(produce(services.kafka, topic, 40_000, rate=1_000, seed=7, show_progress=False))
    a = workers.start(**FAST, STOCK_LEDGER_FAULT="after_rows@25:stop")
    b = workers.start(**FAST)
    await eventually(lambda: process_state(a.pid) == "T", 60, "worker A to freeze inside its transaction", workers)
    await eventually(lambda: b.metric("stock_ledger_assigned_partitions") == 24, 60, "B to claim all 24", workers)
    a.signal(signal.SIGCONT)
    await eventually(lambda: (a.metric("stock_ledger_batches_fenced_total") or 0) >= 1, 60,
                     "A's batch to be fenced after it woke", workers)
    assert '"batch.fenced"' in a.log_text()

    rng = random.Random()
    for victim in (b, a):
        await asyncio.sleep(rng.uniform(1, 3))
        victim.signal(signal.SIGSTOP)
        await asyncio.sleep(7)  # longer than the 4 s session: its partitions move to the other worker
        victim.signal(signal.SIGCONT)
    await producer
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=40_000, pool=workers)
    workers.assert_no_tracebacks()
    assert a.alive() or a.wait(0) != 0  # A may restart itself after being fenced; it never corrupts


async def test_a_replacement_with_the_same_static_member_id_fences_the_frozen_original(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Static membership (the pod name as group.instance.id), as after `kubectl delete --force`: the original is
    frozen inside its transaction, a replacement with the same instance id joins, keeps the assignment without a
    rebalance, and still bumps every epoch when it claims; the thawed original cannot commit."""
    producer = asyncio.create_task(produce(services.kafka, topic, 20_000, rate=1_000, seed=11, show_progress=False))
    original = workers.start(**FAST, STOCK_LEDGER_GROUP_INSTANCE_ID="stock-ledger-0",
                             STOCK_LEDGER_FAULT="after_rows@15:stop")
    await eventually(lambda: process_state(original.pid) == "T", 60, "the original to freeze", workers)
    replacement = workers.start(**FAST, STOCK_LEDGER_GROUP_INSTANCE_ID="stock-ledger-0")
    await eventually(lambda: replacement.metric("stock_ledger_assigned_partitions") == 24, 60,
                     "the replacement to claim all 24", workers)
    original.signal(signal.SIGCONT)
    # Its batch is fenced; seeing the claim came from a newer process with its own instance id, it exits.
    assert original.wait(60) == 1, workers.logs_tail()
    assert '"batch.fenced"' in original.log_text()
    assert "this process is a zombie and exits" in original.log_text()
    assert replacement.alive()
    await producer
    await wait_drained(services, database, topic, workers.group, 120, workers)
    await assert_exact(services, database, topic, workers.group, rows=20_000, pool=workers)
    workers.assert_no_tracebacks()


async def test_sigterm_during_a_busy_batch_exits_zero_quickly_and_the_survivor_takes_over(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """Two workers draining a large backlog (always mid-batch). SIGTERM to one: it exits 0 within 10 s, its last
    batch entirely applied or not at all (the ledger is atomic right after), and the survivor finishes the work
    without a duplicate."""
    await produce(services.kafka, topic, 150_000, show_progress=False)
    leaving = workers.start(STOCK_LEDGER_BATCH_MAX_RECORDS="2000")
    staying = workers.start(STOCK_LEDGER_BATCH_MAX_RECORDS="2000")
    await eventually(lambda: (leaving.metric("stock_ledger_assigned_partitions") or 0) > 0
                     and (staying.metric("stock_ledger_assigned_partitions") or 0) > 0, 60,
                     "both workers to hold partitions", workers)
    await eventually(lambda: (leaving.metric("stock_ledger_batches_committed_total") or 0) >= 3, 60,
                     "the leaving worker to be busy", workers)
    started = time.monotonic()
    leaving.signal(signal.SIGTERM)
    assert leaving.wait(10) == 0, workers.logs_tail()
    assert time.monotonic() - started < 10
    rows, stored = await assert_atomic(database, topic, workers.group)
    assert rows == stored
    await wait_drained(services, database, topic, workers.group, 180, workers)
    await assert_exact(services, database, topic, workers.group, rows=150_000, pool=workers)
    workers.assert_no_tracebacks()
