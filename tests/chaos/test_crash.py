"""Hard kills: the failures that graceful shutdown hides. Real worker processes, SIGKILL, restart, full check."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest

from tests.support.helpers import Env, Services, WorkerPool, assert_atomic, assert_exact, wait_drained
from tests.support.services import produce

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.asyncio]


@pytest.mark.parametrize("point", ["after_read", "after_rows", "before_commit", "after_commit"])
async def test_a_kill_at_each_crash_point_loses_nothing_and_duplicates_nothing(
    point: str, services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The worker SIGKILLs itself at `point` of its third batch. The ledger is atomic at that instant (every
    partition holds exactly the rows below its stored offset), and a restarted worker completes it exactly."""
    await produce(services.kafka, topic, 6_000, show_progress=False)
    crashing = workers.start(STOCK_LEDGER_FAULT=f"{point}@3", STOCK_LEDGER_BATCH_MAX_RECORDS="500")
    assert crashing.wait(60) == -signal.SIGKILL, workers.logs_tail()
    rows, stored = await assert_atomic(database, topic, workers.group)
    assert rows == stored
    assert 0 < rows < 6_000 if point != "after_read" else rows < 6_000

    workers.start(STOCK_LEDGER_BATCH_MAX_RECORDS="500")
    await wait_drained(services, database, topic, workers.group, 90, workers)
    await assert_exact(services, database, topic, workers.group, rows=6_000, pool=workers)
    workers.assert_no_tracebacks()


async def test_staging_scenario_50k_movements_at_2000_per_second_with_five_sigkills(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The staging pipeline: 50,000 movements produced at ~2,000/s while the worker is SIGKILLed five times at
    random moments and restarted (as Kubernetes would). Afterwards count == count(DISTINCT source) == 50,000, no
    gap, stock levels exact, stored offsets at the log end."""
    rng = random.Random()
    producer = asyncio.create_task(produce(services.kafka, topic, 50_000, rate=2_000, show_progress=False))
    worker = workers.start()
    kills = 0
    started = time.monotonic()
    while kills < 5:
        await asyncio.sleep(rng.uniform(2, 4.5))
        worker.signal(signal.SIGKILL)
        worker.wait(10)
        kills += 1
        rows, stored = await assert_atomic(database, topic, workers.group)
        assert rows == stored
        worker = workers.start()
    await producer
    await wait_drained(services, database, topic, workers.group, 120, workers)
    elapsed = time.monotonic() - started
    state = await assert_exact(services, database, topic, workers.group, rows=50_000, pool=workers)
    workers.assert_no_tracebacks()
    assert (state.rows, state.distinct_sources) == (50_000, 50_000)
    print(f"staging scenario: 50000|50000 after {kills} SIGKILLs in {elapsed:.1f}s")
