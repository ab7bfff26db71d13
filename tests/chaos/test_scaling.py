"""What an autoscaler does to the group (the chart's autoscaling: KEDA or an HPA on lag): add workers while records
arrive, then take them away one by one with SIGTERM, as a Deployment scaled down does. Every step is a real
rebalance of the group (aiokafka revokes every partition and assigns them again); the ledger stays exact."""

from __future__ import annotations

import asyncio
import signal

import asyncpg
import pytest

from tests.support.helpers import Env, Services, WorkerPool, assert_exact, eventually, wait_drained
from tests.support.services import produce

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.asyncio]

COUNT = 24_000


async def owners(db: Env, topic: str, group: str) -> int:
    """How many group members hold partitions in PostgreSQL now (each claim records the claiming member)."""
    conn = await asyncpg.connect(db.owner_url)
    try:
        return int(await conn.fetchval(
            "SELECT count(DISTINCT member_id) FROM consumer_offsets WHERE group_id = $1 AND topic = $2", group, topic))
    finally:
        await conn.close()


@pytest.mark.timeout(240)
async def test_scaling_up_and_down_under_load_stays_exact(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """1. One worker drains while 24,000 movements arrive at 1,200/s.
    2. Scale up to four (three started at once, one scaling step): the partitions spread over four owners.
    3. Scale down to one, a worker at a time (SIGTERM, each exits 0 after its batch): one owner again.
    4. After the load: drained, every record exactly once, stock levels exact, no stack trace; the remaining
       worker went through every rebalance."""
    load = asyncio.create_task(produce(services.kafka, topic, COUNT, rate=1_200, show_progress=False))
    first = workers.start()
    await eventually(lambda: owners(database, topic, workers.group), 60, "the first worker claiming", workers)

    added = [workers.start() for _ in range(3)]

    async def spread(n: int) -> bool:
        return await owners(database, topic, workers.group) == n

    await eventually(lambda: spread(4), 60, "the partitions spread over four workers", workers)
    assert not load.done(), "the load ended before the scale-up: raise COUNT"

    for worker in added:
        await asyncio.sleep(1.5)
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.wait, 30) == 0, workers.logs_tail()
    await eventually(lambda: spread(1), 60, "one worker owning every partition again", workers)

    await load
    await wait_drained(services, database, topic, workers.group, 90, workers)
    state = await assert_exact(services, database, topic, workers.group, rows=COUNT, pool=workers)
    assert (state.rows, state.distinct_sources) == (COUNT, COUNT)
    assert first.alive(), workers.logs_tail()
    rebalances = first.metric("stock_ledger_rebalances_total")
    assert rebalances is not None
    assert rebalances >= 3, f"the remaining worker saw {rebalances} rebalances"
    workers.assert_no_tracebacks()
