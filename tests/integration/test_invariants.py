"""The incremental invariant checks (invariants.py) on a real PostgreSQL: they see every row exactly once, even
when batches commit out of order, and each check can fail."""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg
import pytest
import pytest_asyncio

from stock_ledger.invariants import Invariants

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from tests.helpers import Env

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOPIC = "warehouse.movements"
GROUP = "stock-ledger"


@pytest_asyncio.fixture
async def conn(database: Env) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(database.owner_url)
    await c.execute("""INSERT INTO consumer_offsets (group_id, topic, partition, next_offset)
                       SELECT $1, $2, p, 0 FROM generate_series(0, 3) AS p""", GROUP, TOPIC)
    yield c
    await c.close()


async def batch(conn: asyncpg.Connection, partition: int, count: int, qty: int = 3, sku: str = "SKU-") -> None:
    """What a worker's batch writes, in the caller's transaction: rows after the stored offset, the levels, the
    offset."""
    start = await conn.fetchval("SELECT next_offset FROM consumer_offsets WHERE topic = $1 AND partition = $2",
                                TOPIC, partition)
    await conn.execute("""
        INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic,
                                     kafka_partition, kafka_offset)
        SELECT gen_random_uuid(), 'WH-1', $6 || (o % 3), $4, 'receipt', now(), $1, $2, o
          FROM generate_series($3::bigint, $3::bigint + $5 - 1) AS o""", TOPIC, partition, start, qty, count, sku)
    await conn.execute("""
        INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand)
        SELECT 'WH-1', $4 || (o % 3), sum($2::bigint) FROM generate_series($1::bigint, $1::bigint + $3 - 1) AS o
         GROUP BY 2
        ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + excluded.on_hand""", start, qty, count, sku)
    await conn.execute("UPDATE consumer_offsets SET next_offset = next_offset + $3 WHERE topic = $1 AND partition = $2",
                       TOPIC, partition, count)


async def test_each_check_adds_only_the_rows_applied_since_the_previous_one(conn: asyncpg.Connection) -> None:
    """A baseline over 1,000 rows, then 30 rows in two partitions: the incremental check reads those 30 rows, not
    the 1,030, and finds the ledger consistent; a check with nothing new reads nothing."""
    async with conn.transaction():
        await batch(conn, 0, 1_000)
    checks = Invariants(full_scan_seconds=3600)
    baseline = await checks.check(conn, full=False)
    assert (baseline.scope, baseline.level_mismatches, baseline.partitions_ahead) == ("baseline", 0, 0)
    async with conn.transaction():
        await batch(conn, 1, 10)
        await batch(conn, 2, 20)
    checked = await checks.check(conn, full=False)
    assert (checked.scope, checked.rows_checked, checked.level_mismatches) == ("incremental", 30, 0)
    assert checked.coordinates_unique
    idle = await checks.check(conn, full=False)
    assert (idle.rows_checked, idle.level_mismatches) == (0, 0)


async def test_a_batch_that_commits_late_is_still_counted(conn: asyncpg.Connection, database: Env) -> None:
    """Batch A (partition 0) writes its rows and is still open while batch B (partition 1) commits and a check
    runs; then A commits. The next check adds A's rows: the stored offsets are the watermark, and a partition's
    rows become visible with its offset, so a late commit cannot fall below a watermark already passed."""
    checks = Invariants(full_scan_seconds=3600)
    await checks.check(conn, full=False)
    late = await asyncpg.connect(database.owner_url)
    try:
        tx = late.transaction()
        await tx.start()
        await batch(late, 0, 50, qty=7, sku="SKU-LATE-")  # other SKUs: no row lock shared with batch B
        async with conn.transaction():
            await batch(conn, 1, 5)
        first = await checks.check(conn, full=False)
        assert (first.rows_checked, first.level_mismatches) == (5, 0)
        await tx.commit()
    finally:
        await late.close()
    second = await checks.check(conn, full=False)
    assert (second.rows_checked, second.level_mismatches) == (50, 0)


async def test_each_invariant_can_fail(conn: asyncpg.Connection) -> None:
    """A stock level changed behind the ledger's back: the incremental check reports a mismatch, the full pass
    counts exactly one. A row written past its partition's stored offset: one partition ahead. The unique
    constraint dropped: reported."""
    async with conn.transaction():
        await batch(conn, 0, 100)
    checks = Invariants(full_scan_seconds=3600)
    await checks.check(conn, full=False)
    await conn.execute("UPDATE stock_levels SET on_hand = on_hand + 1 WHERE sku = 'SKU-1'")
    assert (await checks.check(conn, full=False)).level_mismatches == 1
    full = await checks.check(conn, full=True)
    assert (full.scope, full.level_mismatches) == ("full", 1)

    await conn.execute("""INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at,
                          kafka_topic, kafka_partition, kafka_offset)
                          VALUES (gen_random_uuid(), 'WH-1', 'SKU-9', 1, 'receipt', now(), $1, 2, 0)""", TOPIC)
    assert (await checks.check(conn, full=False)).partitions_ahead == 1

    await conn.execute("ALTER TABLE stock_movements DROP CONSTRAINT stock_movements_coordinates_key")
    assert not (await checks.check(conn, full=False)).coordinates_unique
