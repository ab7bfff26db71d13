"""The incremental invariant checks (invariants.py) on a real PostgreSQL and Kafka: they see every row exactly
once, even when batches commit out of order or an operator writes below the stored offset; they find records in
neither table (holes) but not transaction markers; a database that goes back in time takes a new baseline, never a
false mismatch; and each check can fail."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import uuid
from typing import TYPE_CHECKING

import asyncpg
import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin.records_to_delete import RecordsToDelete
from aiokafka.structs import TopicPartition
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from stock_ledger.audit.compare import TopicRecords
from stock_ledger.audit.invariants import Invariants
from stock_ledger.cli.rejected import replay as rejected_replay
from stock_ledger.config import Settings
from stock_ledger.metrics import Metrics
from stock_ledger.worker.monitor import PositionMonitor
from tests.support.helpers import make_segments, topic_offsets
from tests.support.services import kafka_admin

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from tests.support.helpers import Env, Services

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOPIC = "warehouse.movements"
GROUP = "stock-ledger"


@pytest_asyncio.fixture
async def conn(database: Env) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(database.owner_url)
    await c.execute("""INSERT INTO consumer_offsets (group_id, topic, partition, next_offset)
                       SELECT $1, $2, p, 0 FROM generate_series(0, 3) AS p""", GROUP, TOPIC)
    await make_segments(c, range(4))  # these tests write rows by hand, not all through batch()
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


# ------------------------------------------------------------------------------------------ holes and rewinds

async def apply_offsets(conn: asyncpg.Connection, topic: str, partition: int, offsets: list[int], qty: int = 2,
                        *, stored: int | None = None) -> None:
    """A worker's batch over exactly these offsets (others, such as transaction markers, have no record), in one
    transaction: the rows, their levels, the stored offset (`stored`, default the last offset + 1)."""
    await make_segments(conn, {partition: max(offsets)})
    async with conn.transaction():
        await conn.execute("""
            INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic,
                                         kafka_partition, kafka_offset)
            SELECT gen_random_uuid(), 'WH-1', 'SKU-' || (o % 3), $3, 'receipt', now(), $1, $2, o
              FROM unnest($4::bigint[]) AS o""", topic, partition, qty, offsets)
        await conn.execute("""
            INSERT INTO stock_levels AS l (warehouse_id, sku, on_hand)
            SELECT 'WH-1', 'SKU-' || (o % 3), sum($1::bigint) FROM unnest($2::bigint[]) AS o GROUP BY 2
            ON CONFLICT (warehouse_id, sku) DO UPDATE SET on_hand = l.on_hand + excluded.on_hand""", qty, offsets)
        await conn.execute("""
            INSERT INTO consumer_offsets (group_id, topic, partition, next_offset) VALUES ($1, $2, $3, $4)
            ON CONFLICT (group_id, topic, partition) DO UPDATE SET next_offset = excluded.next_offset""",
                           GROUP, topic, partition, stored if stored is not None else max(offsets) + 1)


async def produce(bootstrap: str, topic: str, partition: int, count: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    await producer.start()
    try:
        for i in range(count):
            await producer.send_and_wait(topic, b'{"n": %d}' % i, key=b"SKU-1", partition=partition)
    finally:
        await producer.stop()


async def produce_transactions(bootstrap: str, topic: str, partition: int) -> None:
    """5 records committed, 3 aborted, 4 committed: offsets 0-4 records, 5 a commit marker, 6-8 aborted, 9 an abort
    marker, 10-13 records, 14 a commit marker."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"tx-{uuid.uuid4().hex[:8]}")
    await producer.start()
    try:
        for count, commit in ((5, True), (3, False), (4, True)):
            await producer.begin_transaction()
            for i in range(count):
                await producer.send_and_wait(topic, b"{}", key=b"SKU-%d" % i, partition=partition)
            await (producer.commit_transaction() if commit else producer.abort_transaction())
    finally:
        await producer.stop()


@pytest_asyncio.fixture
async def records(services: Services) -> AsyncIterator[TopicRecords]:
    consumer = AIOKafkaConsumer(bootstrap_servers=services.kafka, enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="none")
    await consumer.start()
    yield TopicRecords(consumer)
    await consumer.stop()


@pytest_asyncio.fixture
async def owner(database: Env) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(database.owner_url)
    yield c
    await c.close()


async def test_transaction_markers_and_aborted_records_are_not_holes(
        owner: asyncpg.Connection, topic: str, services: Services, records: TopicRecords) -> None:
    """A transactional producer leaves offsets without a committed record (markers, an aborted transaction): the
    worker applies only the 9 records, its stored offset passes the rest. The check finds 6 offsets in neither
    table, reads the partition from Kafka and reports no hole; the level sum is consistent."""
    await produce_transactions(services.kafka, topic, 0)
    applied = (await topic_offsets(services.kafka, topic))[0]
    assert applied == [0, 1, 2, 3, 4, 10, 11, 12, 13]
    checks = Invariants(full_scan_seconds=3600)
    await apply_offsets(owner, topic, 0, [0], stored=1)
    await checks.check(owner, full=False, records=records)
    await apply_offsets(owner, topic, 0, applied[1:], stored=15)  # the last marker too: the log end
    checked = await checks.check(owner, full=False, records=records)
    assert (checked.scope, checked.offsets_scanned, checked.level_mismatches) == ("incremental", 14, 0)
    assert checked.records_read == 4  # from the first missing offset (5) to the last (14): records 10-13
    assert (checked.missing_records, checked.holes) == (0, {})


async def test_a_hole_is_found_by_the_next_check_exported_and_cleared_by_a_repair(
        owner: asyncpg.Connection, topic: str, services: Services, database: Env) -> None:
    """Partition 2 holds 40 records; a batch applied all of them, then offsets 13-16 were deleted (as the owner)
    before the next check. The monitor's next check finds 4 records in neither table that Kafka holds, exports
    stock_ledger_ledger_missing_records 4 and logs the range; it stays 4 on the next checks, and drops to 0 once the
    rows are written back below the stored offset (what `stock-ledger repair` does), with no level mismatch left.
    The monitor runs as the worker role, as in production."""
    await produce(services.kafka, topic, 2, 40)
    await apply_offsets(owner, topic, 2, [0], stored=1)
    # As the workers run it: the worker role (SELECT on the tables, nothing more).
    settings = Settings(kafka_bootstrap_servers=services.kafka, database_url=database.worker_url, topic=topic,
                        group_id=GROUP)
    metrics = Metrics(CollectorRegistry())
    metrics.lead(leading=True)  # as the lease makes it: only the monitor leader exports the ledger gauges
    monitor = PositionMonitor(settings, metrics, lambda: asyncpg.connect(database.worker_url))
    missing = functools.partial(metrics.registry.get_sample_value, "stock_ledger_ledger_missing_records")
    try:
        assert missing() == 0  # exported from the start
        (await monitor._invariants())()  # the timer's body (the refresh, then its export), without the lease
        await apply_offsets(owner, topic, 2, list(range(1, 40)))
        await owner.execute("DELETE FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = 2 "
                            "AND kafka_offset BETWEEN 13 AND 16", topic)
        with capture_logs() as logs:
            (await monitor._invariants())()
        assert missing() == 4
        hole = next(e for e in logs if e["event"] == "invariants.hole")
        assert (hole["partition"], hole["records"], hole["offsets"]) == (2, 4, "13-16")
        (await monitor._invariants())()
        assert missing() == 4  # still there: a hole is reported until it is filled
        mismatches = functools.partial(metrics.registry.get_sample_value, "stock_ledger_ledger_stock_level_mismatches")
        assert mismatches() == 1  # the levels still hold the deleted rows' qty
        # The repair: the rows back at their coordinates (their qty is in the levels already: the delete left them).
        await owner.execute("""
            INSERT INTO stock_movements (movement_id, warehouse_id, sku, qty, kind, occurred_at, kafka_topic,
                                         kafka_partition, kafka_offset)
            SELECT gen_random_uuid(), 'WH-1', 'SKU-' || (o % 3), 2, 'receipt', now(), $1, 2, o
              FROM generate_series(13, 16) AS o""", topic)
        (await monitor._invariants())()
        assert (missing(), mismatches()) == (0, 0)
    finally:
        await monitor.close()


async def test_rows_an_operator_writes_below_the_stored_offset_are_counted(
        owner: asyncpg.Connection, database: Env) -> None:
    """Issue 32 item 5: `stock-ledger rejected replay` turns a quarantined record below the stored offset into a
    movement and adds its qty to the levels. The next incremental check counts that row (it was not in the previous
    check's snapshot) and reports no mismatch; the check after it does not count it again."""
    await owner.execute("""INSERT INTO consumer_offsets (group_id, topic, partition, next_offset)
                           VALUES ($1, $2, 0, 0)""", GROUP, TOPIC)
    await make_segments(owner, [0])
    async with owner.transaction():
        await batch(owner, 0, 10)
    value = json.dumps({"movement_id": str(uuid.uuid4()), "warehouse_id": "WH-1", "sku": "SKU-7", "qty": 11,
                        "kind": "receipt", "occurred_at": "2026-11-29T10:00:00+01:00"}).encode()
    await owner.execute("""INSERT INTO rejected_movements (kafka_topic, kafka_partition, kafka_offset, key, value,
                                                           reason_code, reason)
                           VALUES ($1, 0, 10, 'SKU-7', $2, 'invalid_json', 'a parser bug, since fixed')""",
                        TOPIC, value)
    await owner.execute("UPDATE consumer_offsets SET next_offset = 11 WHERE topic = $1 AND partition = 0", TOPIC)
    checks = Invariants(full_scan_seconds=3600)
    await checks.check(owner, full=False)
    await checks.check(owner, full=False)  # the quarantined row is now below the watermark
    settings = Settings(database_url=database.owner_url, topic=TOPIC, group_id=GROUP)
    args = argparse.Namespace(reason=None, batch_size=500, dry_run=False, json=True)
    assert await rejected_replay(settings, args) == 0
    assert await owner.fetchval("SELECT count(*) FROM stock_movements WHERE kafka_offset = 10") == 1
    replayed = await checks.check(owner, full=False)
    assert (replayed.scope, replayed.rows_checked, replayed.level_mismatches) == ("incremental", 1, 0)
    again = await checks.check(owner, full=False)
    assert (again.rows_checked, again.level_mismatches) == (0, 0)
    assert (await checks.check(owner, full=True)).level_mismatches == 0


async def restore_to(conn: asyncpg.Connection, topic: str, partition: int, offset: int) -> None:
    """The partition as an earlier copy of the database held it: rows from `offset` on gone, their qty out of the
    levels, the stored offset at `offset` (what a failover to a lagging standby, or a restore, leaves)."""
    async with conn.transaction():
        await conn.execute("""
            WITH gone AS (DELETE FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = $2
                                                        AND kafka_offset >= $3 RETURNING warehouse_id, sku, qty)
            UPDATE stock_levels AS l SET on_hand = l.on_hand - g.qty
              FROM (SELECT warehouse_id, sku, sum(qty) AS qty FROM gone GROUP BY 1, 2) AS g
             WHERE l.warehouse_id = g.warehouse_id AND l.sku = g.sku""", topic, partition, offset)
        await conn.execute("UPDATE consumer_offsets SET next_offset = $3 WHERE topic = $1 AND partition = $2",
                           topic, partition, offset)


async def test_a_stored_offset_that_goes_back_takes_a_new_baseline(owner: asyncpg.Connection, topic: str,
                                                                   services: Services, records: TopicRecords) -> None:
    """100 records applied and checked, then the database goes back to offset 60 (a lagging standby promoted).
    The next check says so (invariants.rewound, partition 5) and takes a new baseline instead of a mismatch; the
    worker then re-applies 60-99 (new rows, new applied_at) and more: the checks that follow find the ledger
    consistent, with no hole."""
    await produce(services.kafka, topic, 5, 120)
    checks = Invariants(full_scan_seconds=3600)
    await apply_offsets(owner, topic, 5, list(range(100)))
    await checks.check(owner, full=False, records=records)
    await apply_offsets(owner, topic, 5, list(range(100, 110)))
    assert (await checks.check(owner, full=False, records=records)).level_mismatches == 0
    await restore_to(owner, topic, 5, 60)
    with capture_logs() as logs:
        back = await checks.check(owner, full=False, records=records)
    assert (back.scope, back.rewound, back.level_mismatches, back.missing_records) == ("baseline", (5,), 0, 0)
    rewound = next(e for e in logs if e["event"] == "invariants.rewound")
    assert rewound["partitions"] == [5]
    assert rewound["offsets"] == {f"{topic}/5": [110, 60]}
    await apply_offsets(owner, topic, 5, list(range(60, 120)))
    after = await checks.check(owner, full=False, records=records)
    assert (after.scope, after.rows_checked, after.level_mismatches, after.missing_records) == \
        ("incremental", 60, 0, 0)


async def test_a_rewind_the_stored_offset_hides_is_still_seen(owner: asyncpg.Connection, topic: str,
                                                              services: Services, records: TopicRecords) -> None:
    """The two ways a database that went back in time can look ahead again before the next check:
    1. the worker re-applied the lost range (60-99) and more: the last row checked (99) was written again (another
       applied_at); a new baseline, no mismatch, no hole;
    2. the worker skipped the lost range (the bug of issue 30: it wrote 110-119 at the position it held in memory):
       the last row checked is gone; the check scans from the last surviving row and reports records 60-109 (in
       Kafka, in neither table) as a hole, with no false level mismatch."""
    await produce(services.kafka, topic, 6, 120)
    await produce(services.kafka, topic, 7, 120)
    checks = Invariants(full_scan_seconds=3600)
    for p in (6, 7):
        await apply_offsets(owner, topic, p, list(range(100)))
    await checks.check(owner, full=False, records=records)
    for p in (6, 7):
        await restore_to(owner, topic, p, 60)
    await apply_offsets(owner, topic, 6, list(range(60, 110)))  # 1. re-applied
    await apply_offsets(owner, topic, 7, list(range(110, 120)))  # 2. skipped 60-109
    checked = await checks.check(owner, full=False, records=records)
    assert (checked.scope, checked.rewound, checked.level_mismatches) == ("baseline", (6, 7), 0)
    assert checked.holes == {(topic, 7): [(60, 109)]}
    assert checked.missing_records == 50
    assert checked.offsets_scanned == (110 - 100) + (120 - 60)  # from after the last surviving row, not from 0


async def test_the_cost_follows_the_new_range_not_the_ledger(owner: asyncpg.Connection, topic: str,
                                                             services: Services, records: TopicRecords) -> None:
    """10,000 rows already checked, 30 more applied in partition 3: the next check scans 30 offsets for holes,
    adds 30 rows' qty and reads nothing from Kafka (no offset is missing from both tables)."""
    await apply_offsets(owner, topic, 3, list(range(10_000)))
    checks = Invariants(full_scan_seconds=3600)
    await checks.check(owner, full=False, records=records)
    await apply_offsets(owner, topic, 3, list(range(10_000, 10_030)))
    checked = await checks.check(owner, full=False, records=records)
    assert (checked.rows_checked, checked.offsets_scanned, checked.records_read) == (30, 30, 0)
    assert (checked.level_mismatches, checked.missing_records) == (0, 0)


async def test_only_the_monitored_topic_is_read_for_holes(owner: asyncpg.Connection, topic: str,
                                                          records: TopicRecords) -> None:
    """The database also holds a stored offset of a topic this broker does not have (another deployment's), with
    offsets in neither table, and a partition whose offset row was deleted. With holes_in=<our topic> the checks
    never try to read the foreign topic from Kafka; the deleted row counts as a rewind, not an error."""
    checks = Invariants(full_scan_seconds=3600, holes_in=topic)
    await apply_offsets(owner, topic, 4, list(range(10)))
    await apply_offsets(owner, "not.on.this.broker", 0, [0], stored=1)
    await checks.check(owner, full=False, records=records)
    await apply_offsets(owner, "not.on.this.broker", 0, [50], stored=100)  # 1-49, 51-99 in neither table
    await owner.execute("DELETE FROM consumer_offsets WHERE topic = $1 AND partition = 4", topic)
    checked = await checks.check(owner, full=False, records=records)
    assert (checked.records_read, checked.missing_records, checked.rewound) == (0, 0, (4,))


async def test_a_stored_offset_past_the_log_end_is_not_read_forever(owner: asyncpg.Connection, topic: str,
                                                                   services: Services,
                                                                   records: TopicRecords) -> None:
    """Partition 8 holds 5 records but its stored offset says 20 (a recreated topic: StockLedgerLogGap's case):
    offsets 5-19 are in neither table and Kafka has nothing there. The check reads up to the log end only,
    promptly, and reports no hole."""
    await produce(services.kafka, topic, 8, 5)
    checks = Invariants(full_scan_seconds=3600, holes_in=topic)
    await apply_offsets(owner, topic, 8, [0], stored=1)
    await checks.check(owner, full=False, records=records)
    await apply_offsets(owner, topic, 8, [1, 2, 3, 4], stored=20)
    checked = await asyncio.wait_for(checks.check(owner, full=False, records=records), timeout=5)
    assert (checked.offsets_scanned, checked.records_read, checked.missing_records) == (19, 0, 0)


async def test_a_replay_leaves_the_alerts_series_at_0(owner: asyncpg.Connection, database: Env,
                                                      services: Services) -> None:
    """Issue 32 item 5, through the metric the alert reads: the monitor (as the worker role) checks, a quarantined
    record below the stored offset is replayed with `stock-ledger rejected replay`, and on every check after it
    stock_ledger_ledger_stock_level_mismatches and stock_ledger_ledger_missing_records stay 0."""
    await owner.execute("""INSERT INTO consumer_offsets (group_id, topic, partition, next_offset)
                           VALUES ($1, $2, 0, 0)""", GROUP, TOPIC)
    await make_segments(owner, [0])
    async with owner.transaction():
        await batch(owner, 0, 10)
    value = json.dumps({"movement_id": str(uuid.uuid4()), "warehouse_id": "WH-1", "sku": "SKU-7", "qty": -4,
                        "kind": "pick", "occurred_at": "2026-11-29T10:00:00+01:00"}).encode()
    await owner.execute("""INSERT INTO rejected_movements (kafka_topic, kafka_partition, kafka_offset, key, value,
                                                           reason_code, reason)
                           VALUES ($1, 0, 10, 'SKU-7', $2, 'invalid_json', 'a parser bug, since fixed')""",
                        TOPIC, value)
    await owner.execute("UPDATE consumer_offsets SET next_offset = 11 WHERE topic = $1 AND partition = 0", TOPIC)
    settings = Settings(kafka_bootstrap_servers=services.kafka, database_url=database.worker_url, topic=TOPIC,
                        group_id=GROUP)
    metrics = Metrics(CollectorRegistry())
    metrics.lead(leading=True)  # as the lease makes it: only the monitor leader exports the ledger gauges
    monitor = PositionMonitor(settings, metrics, lambda: asyncpg.connect(database.worker_url))

    def series() -> tuple[float | None, float | None]:
        return (metrics.registry.get_sample_value("stock_ledger_ledger_stock_level_mismatches"),
                metrics.registry.get_sample_value("stock_ledger_ledger_missing_records"))

    try:
        (await monitor._invariants())()  # the timer's body (the refresh, then its export), without the lease
        (await monitor._invariants())()
        replay = Settings(database_url=database.owner_url, topic=TOPIC, group_id=GROUP)
        args = argparse.Namespace(reason=None, batch_size=500, dry_run=False, json=True)
        assert await rejected_replay(replay, args) == 0
        for _ in range(3):
            (await monitor._invariants())()
            assert series() == (0, 0)
    finally:
        await monitor.close()


async def test_below_the_log_start_the_ledgers_knowledge_decides(
        owner: asyncpg.Connection, topic: str, services: Services, records: TopicRecords) -> None:
    """Partition 2 holds 40 records, all applied; the ledger knows which of its offsets held no record from 0 on
    (none did). Offsets 13-16 then go missing from the ledger and Kafka deletes everything below 20.
    1. The next check counts 13-16 as a hole (inside the known range Kafka's silence cannot make them markers), as
       verify and repair judge them.
    2. Once they are recorded in ledger_gaps (what repair does with records gone from Kafka), the check after
       leaves them to verify: no hole.
    3. Without that knowledge (a ledger applied before it was recorded), the same offsets are logged as
       unconfirmed, not counted."""
    await produce(services.kafka, topic, 2, 40)
    checks = Invariants(full_scan_seconds=3600)
    await apply_offsets(owner, topic, 2, [0], stored=1)
    await checks.check(owner, full=False, records=records)
    await apply_offsets(owner, topic, 2, list(range(1, 40)))
    await owner.execute("UPDATE consumer_offsets SET non_records_known_from = 0, non_records_known_to = 40")
    await owner.execute("DELETE FROM stock_movements WHERE kafka_topic = $1 AND kafka_partition = 2 "
                        "AND kafka_offset BETWEEN 13 AND 16", topic)
    async with kafka_admin(services.kafka) as admin:
        await admin.delete_records({TopicPartition(topic, 2): RecordsToDelete(before_offset=20)}, timeout_ms=10_000)
    with capture_logs() as logs:
        gone = await checks.check(owner, full=False, records=records)
    assert (gone.missing_records, gone.holes) == (4, {(topic, 2): [(13, 16)]})
    assert [e["offsets"] for e in logs if e["event"] == "invariants.hole"] == ["13-16"]
    await owner.execute("INSERT INTO ledger_gaps (group_id, topic, partition, first_offset, last_offset, reason) "
                        "VALUES ($1, $2, 2, 13, 16, 'skipped_below_log_start')", GROUP, topic)
    assert (await checks.check(owner, full=False, records=records)).holes == {}

    await owner.execute("DELETE FROM ledger_gaps")
    await owner.execute("UPDATE consumer_offsets SET non_records_known_from = NULL, non_records_known_to = NULL")
    unknown = Invariants(full_scan_seconds=3600)
    await owner.execute("UPDATE consumer_offsets SET next_offset = 1")
    await unknown.check(owner, full=False, records=records)
    await owner.execute("UPDATE consumer_offsets SET next_offset = 40")
    with capture_logs() as logs:
        assert (await unknown.check(owner, full=False, records=records)).holes == {}
    assert [e["offsets"] for e in logs if e["event"] == "invariants.unconfirmed"] == ["13-16"]
