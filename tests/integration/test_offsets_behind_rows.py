"""A partition whose stored offset is behind the ledger's own rows, on the real broker and database: the worker
never crash-loops on it, never skips a record because of it, and says so loudly.

Rows at or above a stored offset should not exist (a batch writes its rows and moves the offset in one
transaction), but something outside the worker's guard can leave them: a `repair` racing an `offsets set` (before
they took turns), a tool writing rows, a restore that loses a partition's `consumer_offsets` row but keeps its
movements.
"""

from __future__ import annotations

import json
import signal
import uuid

import asyncpg
import pytest
from aiokafka.admin.records_to_delete import RecordsToDelete
from aiokafka.structs import TopicPartition

from tests.integration.test_repair import send_to_partition
from tests.integration.test_verify import run_verify
from tests.support.helpers import Env, Services, WorkerPool, assert_exact, eventually, movement, wait_drained
from tests.support.services import kafka_admin, produce

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(180)]

P = 7


async def plant(database: Env, topic: str, partition: int, offset: int, qty: int) -> uuid.UUID:
    """A movement at these coordinates written as a repair writes one (its qty added to stock_levels in the same
    transaction), by the owner, outside any worker's guard; its movement_id."""
    movement_id = uuid.uuid4()
    conn = await asyncpg.connect(database.owner_url)
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic, "
                "kafka_partition, kafka_offset) VALUES ($1, 'WH-1', 'SKU-PLANTED', $2, 'receipt', now(), $3, $4, $5)",
                movement_id, qty, topic, partition, offset)
            await conn.execute(
                "INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand) VALUES ('WH-1', 'SKU-PLANTED', $1) "
                "ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + excluded.on_hand", qty)
    finally:
        await conn.close()
    return movement_id


async def stored(database: Env, group: str, partition: int) -> int | None:
    conn = await asyncpg.connect(database.owner_url)
    try:
        return await conn.fetchval("SELECT next_offset FROM consumer_offsets WHERE group_id = $1 AND partition = $2",
                                   group, partition)
    finally:
        await conn.close()


async def test_rows_already_at_a_batchs_coordinates_are_left_as_found_and_the_rest_applied(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """A worker drains 300 movements; partition 7's stored offset is then S. Rows are planted at S and S + 3 (the
    next offset, and one further ahead with records to apply before it), then 6 movements are sent to partition 7
    (offsets S..S+5). The batch's COPY hits the coordinates constraint; the worker (today: exit 1, and again on
    every restart) redoes the batch leaving out the two coordinates already in the ledger, applies the 4 others,
    logs a `batch.coordinates_present` error naming them and counts 2 in
    stock_ledger_coordinate_conflicts_total. Same process throughout; the ledger is exact (the planted rows stand
    for offsets S and S+3, levels = Σ movements) and the stored offset reaches the log end."""
    await produce(services.kafka, topic, 300, seed=71, show_progress=False)
    worker = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    start = await stored(database, workers.group, P)
    assert start is not None
    await plant(database, topic, P, start, qty=4)
    await plant(database, topic, P, start + 3, qty=6)
    sent = [movement("SKU-7", qty=i + 1) for i in range(6)]
    await send_to_partition(services.kafka, topic, P, [(b"SKU-7", json.dumps(m).encode()) for m in sent])
    await wait_drained(services, database, topic, workers.group, 30, workers)
    assert worker.alive(), worker.log_tail(30)
    await eventually(lambda: worker.metric("stock_ledger_coordinate_conflicts_total") == 2, 10,
                     "the conflict counted", workers)
    events = [json.loads(line) for line in worker.log_text().splitlines() if '"batch.coordinates_present"' in line]
    assert events, worker.log_tail(30)
    assert {e["level"] for e in events} == {"error"}
    # One event per batch that met them (one batch, unless the six records arrived in two fetches).
    assert sorted(o for e in events for o in e["offsets"][str(P)]) == [start, start + 3]
    await assert_exact(services, database, topic, workers.group, rows=300 + 6, pool=workers)
    conn = await asyncpg.connect(database.owner_url)
    try:
        applied = {str(r[0]) for r in await conn.fetch(
            "SELECT movement_id FROM stock_movements WHERE kafka_partition = $1 AND kafka_offset >= $2", P, start)}
    finally:
        await conn.close()
    assert {m["movement_id"] for i, m in enumerate(sent) if i not in {0, 3}} <= applied
    assert not {sent[0]["movement_id"], sent[3]["movement_id"]} & applied
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    workers.assert_no_tracebacks()


@pytest.mark.parametrize("policy", ["earliest", "latest"])
async def test_a_lost_offsets_row_resumes_from_the_ledgers_own_rows_never_the_reset_policy(
    services: Services, database: Env, topic: str, workers: WorkerPool, policy: str,
) -> None:
    """A worker drains 300 movements and stops; partition 7 then holds rows up to S - 1 and its stored offset S.
    A restore to before its first claim loses its consumer_offsets row (deleted here) but not its rows. 50 more
    movements go to partition 7 (S..S+49) and retention deletes them below S + 20 before anything applies them.
    A worker with STOCK_LEDGER_AUTO_OFFSET_RESET=`policy` and STOCK_LEDGER_ON_GAP=record claims the partition:
    its rows say it was claimed, so it starts at S (today: the reset policy's S + 20 or the log end, losing
    S..S+19, or all 50, with no trace), logs `claim.resumed_from_ledger`, records S..S+19 as an unacknowledged
    gap (below the log start: they can no longer be applied), and applies S+20..S+49: exact, verify fails on that
    gap only."""
    await produce(services.kafka, topic, 300, seed=72, show_progress=False)
    first = workers.start()
    await wait_drained(services, database, topic, workers.group, 60, workers)
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 0
    start = await stored(database, workers.group, P)
    assert start is not None
    conn = await asyncpg.connect(database.owner_url)
    try:
        await conn.execute("DELETE FROM consumer_offsets WHERE partition = $1", P)
    finally:
        await conn.close()
    more = [movement("SKU-7", qty=1) for _ in range(50)]
    await send_to_partition(services.kafka, topic, P, [(b"SKU-7", json.dumps(m).encode()) for m in more])
    async with kafka_admin(services.kafka) as admin:
        await admin.delete_records({TopicPartition(topic, P): RecordsToDelete(before_offset=start + 20)},
                                   timeout_ms=10_000)

    worker = workers.start(STOCK_LEDGER_AUTO_OFFSET_RESET=policy, STOCK_LEDGER_ON_GAP="record")
    await wait_drained(services, database, topic, workers.group, 60, workers)
    await assert_exact(services, database, topic, workers.group, rows=300 + 30, pool=workers)
    conn = await asyncpg.connect(database.owner_url)
    try:
        gaps = [tuple(r) for r in await conn.fetch(
            "SELECT partition, first_offset, last_offset, reason, acknowledged_at FROM ledger_gaps")]
    finally:
        await conn.close()
    assert gaps == [(P, start, start + 19, "below_log_start", None)]
    resumed = [json.loads(line) for line in worker.log_text().splitlines() if '"claim.resumed_from_ledger"' in line]
    assert [(e["level"], e["partition"], e["offset"]) for e in resumed] == [("error", P, start)]
    verified = await run_verify(workers)
    assert verified.code == 1
    assert verified.check("no unacknowledged gap (ledger_gaps)").startswith(f"FAIL    1 open: p{P} {start}-")
    assert verified.check("gaps (in topic, in neither table)") == "ok      none"
    workers.assert_no_tracebacks()
