"""A topic written by a transactional producer (as Kafka Streams and every exactly-once producer write it), on the
real broker and database.

Every transaction ends in a control record (a commit or abort marker) that takes an offset of each partition it
wrote; an aborted transaction's records take offsets too. read_committed returns neither, so those offsets hold no
data record. The ledger must read past them (a drained partition's stored offset is its log end) and must never
take them for holes, even once retention has deleted them and Kafka can no longer say what they held.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin.records_to_delete import RecordsToDelete
from aiokafka.structs import TopicPartition
from structlog.testing import capture_logs

from stock_ledger.audit.compare import TopicRecords
from stock_ledger.audit.invariants import Invariants
from stock_ledger.config import Settings
from stock_ledger.topics import committed_offsets
from tests.integration.test_operate import cli
from tests.integration.test_verify import run_verify, sql
from tests.support.helpers import (
    Env,
    Services,
    WorkerPool,
    assert_exact,
    end_offsets,
    eventually,
    movement,
    topic_offsets,
    wait_drained,
)
from tests.support.services import kafka_admin

pytestmark = [pytest.mark.integration, pytest.mark.asyncio, pytest.mark.timeout(240)]


async def transactions(bootstrap: str, topic: str, partitions: range, outcomes: list[bool], per_partition: int = 9,
                       ) -> int:
    """One transaction per outcome (True: committed, False: aborted), each with `per_partition` movements to every
    partition of `partitions`; the number of committed movements. Each transaction takes per_partition + 1 offsets
    of each partition: its records and its marker."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"tx-{uuid.uuid4().hex[:8]}")
    await producer.start()
    committed = 0
    try:
        for commit in outcomes:
            await producer.begin_transaction()
            for p in partitions:
                for _ in range(per_partition):
                    m = movement(f"SKU-{p}", qty=1 if commit else 1000)
                    await producer.send(topic, json.dumps(m).encode(), key=f"SKU-{p}".encode(), partition=p)
            await (producer.commit_transaction() if commit else producer.abort_transaction())
            committed += per_partition * len(partitions) if commit else 0
    finally:
        await producer.stop()
    return committed


@pytest_asyncio.fixture
async def records(services: Services) -> AsyncIterator[TopicRecords]:
    """The invariant check's reader of the topic, as the monitor builds it (read_committed, no group)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=services.kafka, enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="none")
    await consumer.start()
    yield TopicRecords(consumer)
    await consumer.stop()


async def test_a_drained_transactional_topic_is_stored_to_its_log_end(
    services: Services, database: Env, topic: str, workers: WorkerPool,
) -> None:
    """30 transactions of 9 movements on each of partitions 0-3, every fifth aborted, the last one too: each of
    those partitions holds commit markers, runs of aborted records, abort markers, and ends past its last record
    (288) in a commit marker (289), 9 aborted records and an abort marker (290-299). A worker drains them. Every
    partition's stored offset is its log end (300 on 0-3, 0 on the others), never the last record + 1 (today: 289,
    so lag read 11 forever); the lag metric is 0 on every partition and Kafka's committed offsets reach the log
    end; the ledger is exact (864 movements, none of an aborted transaction) and verify passes."""
    committed = await transactions(services.kafka, topic, range(4), [i % 5 != 4 for i in range(30)])
    assert committed == 24 * 9 * 4
    worker = workers.start()
    await wait_drained(services, database, topic, workers.group, 30, workers)
    ends = await end_offsets(services.kafka, topic)
    last = {p: offsets[-1] for p, offsets in (await topic_offsets(services.kafka, topic)).items() if offsets}
    assert sorted(last) == [0, 1, 2, 3]
    # What the test is about: each log ends offsets past its last record (288 and 300 as produced; a broker that
    # restarted meanwhile may have added a marker).
    assert all(ends[p] > last[p] + 1 for p in last), (ends, last)
    conn = await asyncpg.connect(database.owner_url)
    try:
        stored = {r[0]: r[1] for r in await conn.fetch(
            "SELECT partition, next_offset FROM consumer_offsets WHERE group_id = $1", workers.group)}
    finally:
        await conn.close()
    assert stored == ends
    await assert_exact(services, database, topic, workers.group, rows=committed, pool=workers)

    def lags() -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

        _, body = worker.get("/metrics")
        return {s.labels["partition"]: s.value for f in text_string_to_metric_families(body) for s in f.samples
                if s.name == "stock_ledger_partition_lag_messages"}

    await eventually(lambda: len(lags()) == 24 and not any(lags().values()), 15, "lag 0 on every partition", workers)
    settings = Settings(kafka_bootstrap_servers=services.kafka, topic=topic, group_id=workers.group)

    async def told() -> bool:
        return {p: o for p, o in (await committed_offsets(settings)).items() if o} == dict.fromkeys(range(4), 300)

    await eventually(told, 15, "Kafka's committed offsets at the log end", workers)
    assert (await run_verify(workers)).code == 0


async def test_markers_and_aborted_records_deleted_by_retention_are_not_holes(
    services: Services, database: Env, topic: str, workers: WorkerPool, records: TopicRecords,
) -> None:
    """Partition 3 holds 23 transactions of 9 movements, the 5th, 10th and 15th aborted: a record at every offset
    but each tenth (the markers), and three runs of 9 aborted records. A worker applies them; then Kafka deletes the
    partition below offset 150 (as retention would), so it can no longer say what offsets 0-149 held.
    1. The invariant check (its baseline taken before the worker applied anything) scans 0-229 and finds no hole,
       and no offset it cannot confirm (today: it warned about the 42 offsets below the log start).
    2. `repair` exits 0 and records no ledger_gaps row (today: exit 3, the 42 offsets "gone" and recorded).
    3. verify passes, and says nothing of these offsets is gone.
    4. The same ledger as one applied before the worker recorded such offsets (its records of them and its known
       range removed): repair still exits 0 and records nothing, reporting the 42 offsets as unknown, not gone;
       verify passes and says so."""
    outcomes = [i not in {4, 9, 14} for i in range(23)]
    committed = await transactions(services.kafka, topic, range(3, 4), outcomes)
    checks = Invariants(full_scan_seconds=3600)
    owner = await asyncpg.connect(database.owner_url)
    try:
        await checks.check(owner, full=False, records=records)  # the baseline: nothing stored yet
        workers.start()
        await wait_drained(services, database, topic, workers.group, 30, workers)
        await assert_exact(services, database, topic, workers.group, rows=committed, pool=workers)
        async with kafka_admin(services.kafka) as admin:
            await admin.delete_records({TopicPartition(topic, 3): RecordsToDelete(before_offset=150)},
                                       timeout_ms=10_000)
        with capture_logs() as logs:
            checked = await checks.check(owner, full=False, records=records)
        assert (checked.missing_records, checked.holes) == (0, {})
        assert checked.offsets_scanned == 230
        assert [e for e in logs if e["event"] in {"invariants.unconfirmed", "invariants.hole"}] == []
    finally:
        await owner.close()

    repaired = await cli(workers, "repair", "--json")
    assert repaired.code == 0, repaired.out + repaired.err
    assert repaired.json()["totals"]["gone"] == 0
    assert await sql(database, "SELECT count(*) FROM ledger_gaps") == 0
    verified = await run_verify(workers)
    assert verified.code == 0, verified.stdout
    assert verified.check("records gone below the log start") == "ok      none"

    await sql(database, "DELETE FROM non_record_offsets")
    await sql(database, "UPDATE consumer_offsets SET non_records_known_from = NULL, non_records_known_to = NULL")
    old = await cli(workers, "repair", "--json")
    assert old.code == 0, old.out + old.err
    assert (old.json()["totals"]["gone"], old.json()["totals"]["unknown"]) == (0, 42)
    assert [p["unknown_ranges"][:2] for p in old.json()["partitions"] if p["unknown"]] == [[[9, 9], [19, 19]]]
    assert await sql(database, "SELECT count(*) FROM ledger_gaps") == 0
    verified = await run_verify(workers)
    assert verified.code == 0, verified.stdout
    assert verified.check("records gone below the log start").startswith(
        "ok      none; 42 offsets below the log start unknown")
