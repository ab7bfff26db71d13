"""Hard kills: the failures that graceful shutdown hides. Real worker processes, SIGKILL, restart, full check."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import asyncpg
import pytest

from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_atomic,
    assert_exact,
    closings_off,
    eventually,
    wait_drained,
)
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


async def test_a_kill_inside_a_closing_leaves_the_closings_before_it_exact_and_no_trace_of_it(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """The monitor's leader SIGKILLs itself inside its fourth closing (balances copied, COMMIT not sent) while it
    drains a backlog and more movements arrive: the three closings before it stand, each exactly the movements below
    its cut, and nothing of the fourth (no row, no cut, no balance); the ledger is atomic. A restarted worker takes
    closings again, and drains exactly with every closing exact."""
    await produce(services.kafka, topic, 10_000, seed=41, show_progress=False)
    producer = asyncio.create_task(produce(services.kafka, topic, 10_000, seed=42, rate=2_000, show_progress=False))
    slowly = {"STOCK_LEDGER_CLOSING_SECONDS": "1", "STOCK_LEDGER_BATCH_MAX_RECORDS": "200"}
    crashing = workers.start(**slowly, STOCK_LEDGER_FAULT="during_closing@4")
    assert crashing.wait(60) == -signal.SIGKILL, workers.logs_tail()
    conn = await asyncpg.connect(database.owner_url)
    try:
        closings = [tuple(r) for r in await conn.fetch("SELECT closing_id, pairs FROM ledger_closings ORDER BY 1")]
        assert [c[0] for c in closings] == [1, 2, 3], closings
        assert max(c[1] for c in closings) > 0, f"no closing counted a movement: {closings}"
        # The first may have no cut rows: taken before any partition had a stored offset, it counts nothing.
        assert await conn.fetchval("SELECT count(*) FROM closing_cuts WHERE closing_id > 3") == 0
        assert await conn.fetchval("SELECT count(*) FROM stock_closings WHERE closing_id > 3") == 0
        assert await conn.fetchval("SELECT count(*) FROM stock_movements") > 0
    finally:
        await conn.close()
    assert not await closings_off(database.owner_url)
    rows, stored = await assert_atomic(database, topic, workers.group)
    assert rows == stored

    again = workers.start(**slowly)
    await producer
    await wait_drained(services, database, topic, workers.group, 90, workers)
    await eventually(lambda: again.log_text().count('"closing.taken"') >= 2, 30, "closings after the restart",
                     workers)
    await assert_exact(services, database, topic, workers.group, rows=20_000, pool=workers)
    assert not await closings_off(database.owner_url)
    workers.assert_no_tracebacks()
